/* run_report: reward and held-out accuracy of a run by step, as a table and an SVG plot
 * (see run_report.h). */
#include "learner/run_report.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/model.h"
#include "actor/tokenizer.h"
#include "core/status.h"
#include "learner/checkpoint.h"
#include "learner/dataset.h"
#include "learner/eval.h"
#include "lora/peft.h"
#include "reward/reward.h"

/* The metrics keys read from the learner's JSON lines, first match wins. */
static const char *const k_step[] = {"moerl_learner_step", NULL};
static const char *const k_reward[] = {"moerl_learner_reward_mean", NULL};

void report_init(run_report_t *r) {
    memset(r, 0, sizeof *r);
}

void report_free(run_report_t *r) {
    free(r->rows);
    memset(r, 0, sizeof *r);
}

report_row_t *report_row(run_report_t *r, int64_t step) {
    int lo = 0, hi = r->n;
    while (lo < hi) { /* first row with step >= the one asked */
        int mid = (lo + hi) / 2;
        if (r->rows[mid].step < step)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < r->n && r->rows[lo].step == step)
        return &r->rows[lo];
    if (r->n == r->cap) {
        int cap = r->cap ? 2 * r->cap : 64;
        report_row_t *rows = realloc(r->rows, sizeof *rows * (size_t)cap);
        if (!rows)
            return NULL;
        r->rows = rows;
        r->cap = cap;
    }
    memmove(r->rows + lo + 1, r->rows + lo, sizeof *r->rows * (size_t)(r->n - lo));
    r->rows[lo] = (report_row_t){step, NAN, NAN};
    r->n++;
    return &r->rows[lo];
}

static double json_number(const cJSON *o, const char *const *names) {
    for (int i = 0; names[i]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, names[i]);
        if (cJSON_IsNumber(v))
            return v->valuedouble;
    }
    return NAN;
}

int report_read_metrics(run_report_t *r, const char *jsonl_path) {
    FILE *f = fopen(jsonl_path, "r");
    if (!f)
        return mo_errorf(MO_EIO, "cannot read %s: %s", jsonl_path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    int rc = MO_OK;
    while (rc == MO_OK && getline(&line, &cap, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        if (!cJSON_IsObject(o)) {
            cJSON_Delete(o);
            continue;
        }
        const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
        double step = json_number(o, k_step), reward = json_number(o, k_reward);
        bool is_step = cJSON_IsString(ev) && !strcmp(ev->valuestring, "step");
        if (is_step && isfinite(step) && step >= 0 && isfinite(reward)) {
            report_row_t *row = report_row(r, (int64_t)step);
            if (!row)
                rc = mo_errorf(MO_ENOMEM, "out of memory");
            else
                row->reward_mean = reward;
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    return rc;
}

/* ---- Held-out accuracy ---- */

typedef struct evaluator {
    model_t *m;
    tokenizer_t *tok;
    dataset_t *d;
    reward_fn_t *fn;
    eval_opts_t o;
} evaluator_t;

static void evaluator_free(evaluator_t *e) {
    if (e->m)
        model_set_adapter(e->m, NULL);
    model_destroy(&e->m);
    tokenizer_destroy(&e->tok);
    dataset_destroy(&e->d);
    reward_fn_destroy(&e->fn);
}

static int evaluator_open(evaluator_t *e, const moerl_config_t *c, int eval_n) {
    memset(e, 0, sizeof *e);
    model_opts_t mo = {0};
    int rc = model_open(&e->m, c->model.path, &mo);
    if (rc == MO_OK)
        rc = tokenizer_load(c->model.path, &e->tok);
    if (rc == MO_OK)
        rc = dataset_open_config(c, &e->d);
    if (rc == MO_OK) {
        const char *v = dataset_verifier(e->d);
        rc = v ? reward_fn_parse(v, &e->fn)
               : reward_fn_from_config(c->reward.function, c->reward.plugin, &e->fn);
    }
    eval_opts_from_config(&e->o, c);
    e->o.n = eval_n;
    return rc;
}

static int eval_one(evaluator_t *e, run_report_t *r, int64_t step, const char *adapter_dir,
                    report_progress_fn progress, void *arg) {
    lora_adapter_t *ad = NULL;
    if (adapter_dir) {
        int rc = peft_load_new(&ad, adapter_dir, e->m->modules, e->m->n_modules, 1);
        if (rc < 0)
            return mo_error_wrap(rc, "checkpoint adapter %s", adapter_dir);
    }
    eval_result_t res;
    int rc = eval_greedy(e->m, ad, e->tok, e->d, e->fn, &e->o, &res);
    model_set_adapter(e->m, NULL);
    lora_adapter_destroy(&ad);
    TRY(rc);
    report_row_t *row = report_row(r, step);
    if (!row)
        return mo_errorf(MO_ENOMEM, "out of memory");
    row->accuracy = res.accuracy;
    r->eval_n = res.n;
    if (progress)
        progress(arg, step, res.accuracy, res.correct, res.n);
    return MO_OK;
}

int report_eval_checkpoints(run_report_t *r, const moerl_config_t *c, const char *run_dir,
                            int eval_n, report_progress_fn progress, void *arg) {
    int64_t *steps = NULL;
    int n = 0;
    TRY(checkpoint_list(run_dir, &steps, &n));
    evaluator_t e;
    int rc = evaluator_open(&e, c, eval_n);
    if (rc == MO_OK)
        rc = eval_one(&e, r, 0, NULL, progress, arg);
    for (int i = 0; i < n && rc == MO_OK; i++) {
        char name[64], dir[4400];
        checkpoint_step_name(name, sizeof name, steps[i]);
        snprintf(dir, sizeof dir, "%s/%s/%s/%s", run_dir, CKPT_DIR_NAME, name, CKPT_ADAPTER_DIR);
        rc = eval_one(&e, r, steps[i], dir, progress, arg);
    }
    evaluator_free(&e);
    free(steps);
    return rc;
}

/* ---- Table ---- */

const report_row_t *report_first_eval(const run_report_t *r) {
    for (int i = 0; i < r->n; i++)
        if (isfinite(r->rows[i].accuracy))
            return &r->rows[i];
    return NULL;
}

const report_row_t *report_last_eval(const run_report_t *r) {
    for (int i = r->n - 1; i >= 0; i--)
        if (isfinite(r->rows[i].accuracy))
            return &r->rows[i];
    return NULL;
}

static void cell(FILE *out, double v, int width) {
    if (isfinite(v))
        fprintf(out, "%*.3f", width, v);
    else
        fprintf(out, "%*s", width, "-");
}

/* Whether row i gets a line in the table: the evaluated steps (and the last step) when
 * there are evaluations, else about 20 evenly spaced steps and the last. */
static bool table_row(const run_report_t *r, int i, bool evaluated) {
    if (i == r->n - 1)
        return true;
    if (evaluated)
        return isfinite(r->rows[i].accuracy);
    int every = (r->n + 19) / 20;
    return (i + 1) % every == 0;
}

void report_print(const run_report_t *r, FILE *out) {
    bool evaluated = report_first_eval(r) != NULL;
    fprintf(out, "%6s  %11s  %17s\n", "step", "reward mean", "held-out accuracy");
    double sum = 0;
    int n = 0;
    for (int i = 0; i < r->n; i++) {
        if (isfinite(r->rows[i].reward_mean)) {
            sum += r->rows[i].reward_mean;
            n++;
        }
        if (!table_row(r, i, evaluated))
            continue;
        fprintf(out, "%6lld  ", (long long)r->rows[i].step);
        cell(out, n ? sum / n : NAN, 11);
        fputs("  ", out);
        cell(out, r->rows[i].accuracy, 17);
        fputc('\n', out);
        sum = 0;
        n = 0;
    }
    fputs("(reward mean: the sampled completions' reward, averaged over the steps since the "
          "row above)\n",
          out);
    const report_row_t *a = report_first_eval(r), *b = report_last_eval(r);
    if (a && b && a != b)
        fprintf(out,
                "held-out greedy accuracy (%d prompts): %.3f at step %lld, %.3f at step %lld "
                "(%+.1f points)\n",
                r->eval_n, a->accuracy, (long long)a->step, b->accuracy, (long long)b->step,
                100.0 * (b->accuracy - a->accuracy));
    else if (a)
        fprintf(out, "held-out greedy accuracy (%d prompts): %.3f at step %lld\n", r->eval_n,
                a->accuracy, (long long)a->step);
}

/* ---- SVG ---- */

enum { SVG_W = 720, SVG_H = 420, SVG_L = 64, SVG_R = 24, SVG_T = 44, SVG_B = 52 };

typedef struct plot_box {
    double x0, x1, y0, y1; /* data ranges */
} plot_box_t;

static double px(const plot_box_t *b, double x) {
    return SVG_L + (x - b->x0) / (b->x1 - b->x0) * (SVG_W - SVG_L - SVG_R);
}

static double py(const plot_box_t *b, double y) {
    return SVG_T + (b->y1 - y) / (b->y1 - b->y0) * (SVG_H - SVG_T - SVG_B);
}

/* A tick spacing of 1, 2 or 5 times a power of ten giving at most about `want` ticks. */
static double nice_step(double span, int want) {
    double raw = span / want, p = pow(10, floor(log10(raw)));
    double m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
}

static void svg_text_escaped(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

static plot_box_t plot_box(const run_report_t *r) {
    plot_box_t b = {(double)r->rows[0].step, (double)r->rows[r->n - 1].step, 0.0, 1.0};
    for (int i = 0; i < r->n; i++) {
        double v[2] = {r->rows[i].reward_mean, r->rows[i].accuracy};
        for (int k = 0; k < 2; k++) {
            if (isfinite(v[k]) && v[k] < b.y0)
                b.y0 = v[k];
            if (isfinite(v[k]) && v[k] > b.y1)
                b.y1 = v[k];
        }
    }
    if (b.x1 <= b.x0)
        b.x1 = b.x0 + 1;
    return b;
}

static void svg_axes(FILE *f, const plot_box_t *b) {
    double xs = nice_step(b->x1 - b->x0, 8), ys = nice_step(b->y1 - b->y0, 5);
    fputs("<g font-family=\"sans-serif\" font-size=\"12\" fill=\"#333\">\n", f);
    for (double y = ceil(b->y0 / ys) * ys; y <= b->y1 + 1e-9; y += ys) {
        fprintf(f,
                "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                SVG_L, py(b, y), SVG_W - SVG_R, py(b, y), SVG_L - 6, py(b, y) + 4,
                fabs(y) < 1e-12 ? 0.0 : y);
    }
    for (double x = ceil(b->x0 / xs) * xs; x <= b->x1 + 1e-9; x += xs) {
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#eee\"/>"
                "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g</text>\n",
                px(b, x), SVG_T, px(b, x), SVG_H - SVG_B, px(b, x), SVG_H - SVG_B + 18, x);
    }
    fprintf(f,
            "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#888\"/>\n"
            "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">step</text>\n</g>\n",
            SVG_L, SVG_T, SVG_W - SVG_L - SVG_R, SVG_H - SVG_T - SVG_B, (SVG_L + SVG_W - SVG_R) / 2,
            SVG_H - 12);
}

/* One series v (r->n values, one per row): a polyline through its finite points, with
 * dots when asked. Returns the number of points. */
static int svg_series(FILE *f, const run_report_t *r, const plot_box_t *b, const double *v,
                      const char *color, double width, double opacity, bool dots) {
    int n = 0;
    fprintf(f,
            "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%.1f\" "
            "stroke-opacity=\"%.2f\" points=\"",
            color, width, opacity);
    for (int i = 0; i < r->n; i++) {
        if (isfinite(v[i])) {
            fprintf(f, "%s%.1f,%.1f", n ? " " : "", px(b, (double)r->rows[i].step), py(b, v[i]));
            n++;
        }
    }
    fputs("\"/>\n", f);
    for (int i = 0; dots && i < r->n; i++)
        if (isfinite(v[i]))
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
                    px(b, (double)r->rows[i].step), py(b, v[i]), color);
    return n;
}

/* The series of the plot: the reward of each step, its trailing average over *window
 * steps (about 1/25 of the run), the held-out accuracy. v: (3, r->n), malloc'd. */
static double *plot_series(const run_report_t *r, int *window) {
    double *v = malloc(sizeof *v * 3 * (size_t)r->n);
    if (!v)
        return NULL;
    int finite = 0;
    for (int i = 0; i < r->n; i++)
        finite += isfinite(r->rows[i].reward_mean);
    int w = finite / 25 > 1 ? finite / 25 : 1;
    double sum = 0;
    int k = 0, first = 0; /* the window holds finite rewards of rows first..i */
    for (int i = 0; i < r->n; i++) {
        double x = r->rows[i].reward_mean;
        v[i] = x;
        v[2 * r->n + i] = r->rows[i].accuracy;
        v[r->n + i] = NAN;
        if (!isfinite(x))
            continue;
        sum += x;
        k++;
        while (k > w) {
            if (isfinite(r->rows[first].reward_mean)) {
                sum -= r->rows[first].reward_mean;
                k--;
            }
            first++;
        }
        v[r->n + i] = sum / k;
    }
    *window = w;
    return v;
}

int report_write_svg(const run_report_t *r, const char *title, const char *path) {
    if (r->n == 0)
        return mo_errorf(MO_EINVAL, "report: no step to plot");
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        return mo_errorf(MO_EIO, "cannot write %s: %s", tmp, strerror(errno));
    plot_box_t b = plot_box(r);
    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
            "<text x=\"%d\" y=\"26\" font-family=\"sans-serif\" font-size=\"15\" "
            "fill=\"#111\">",
            SVG_W, SVG_H, SVG_W, SVG_H, SVG_L);
    svg_text_escaped(f, title ? title : "");
    fputs("</text>\n", f);
    svg_axes(f, &b);
    int w = 1;
    double *v = plot_series(r, &w);
    if (!v) {
        fclose(f);
        unlink(tmp);
        return mo_errorf(MO_ENOMEM, "out of memory");
    }
    static const char *const colors[2] = {"#1f77b4", "#d62728"};
    char label[2][96];
    if (w > 1)
        snprintf(label[0], sizeof label[0], "reward mean (sampled; thick: average of %d steps)", w);
    else
        snprintf(label[0], sizeof label[0], "reward mean (sampled)");
    snprintf(label[1], sizeof label[1], "held-out greedy accuracy");
    int drawn[2];
    if (w > 1)
        svg_series(f, r, &b, v, colors[0], 1.0, 0.35, false);
    drawn[0] = svg_series(f, r, &b, v + r->n, colors[0], 2.0, 1.0, false);
    drawn[1] = svg_series(f, r, &b, v + 2 * r->n, colors[1], 2.0, 1.0, true);
    free(v);
    for (int k = 0, row = 0; k < 2; k++) {
        if (!drawn[k])
            continue;
        int y = SVG_T + 16 + 18 * row++;
        fprintf(f,
                "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"2\"/>"
                "<text x=\"%d\" y=\"%d\" font-family=\"sans-serif\" font-size=\"12\" "
                "fill=\"#333\">%s</text>\n",
                SVG_L + 10, y - 4, SVG_L + 34, y - 4, colors[k], SVG_L + 40, y, label[k]);
    }
    fputs("</svg>\n", f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return mo_errorf(MO_EIO, "cannot write %s: %s", path, strerror(e));
    }
    return MO_OK;
}
