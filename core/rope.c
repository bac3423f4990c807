/* rope: rotary-embedding frequencies and attention scaling for the RoPE
 * variants of Hugging Face configs (default, linear, llama3, yarn), computed
 * as transformers' modeling_rope_utils computes them. */
#include <math.h>

#include "core/kernels.h"
#include "core/status.h"

/* inv_freq[i] = 1 / theta^(2i / rot) (the default RoPE). */
static void default_inv_freq(float *inv_freq, int rot, float theta) {
    for (int i = 0; i < rot / 2; i++)
        inv_freq[i] = (float)(1.0 / pow((double)theta, (double)(2 * i) / rot));
}

/* Llama 3.1: wavelengths above original / low_freq_factor are divided by
 * factor, those below original / high_freq_factor are kept, and those in
 * between are interpolated smoothly. */
static void llama3_inv_freq(float *inv_freq, int rot, const rope_scaling_t *sc) {
    double factor = sc->factor, lo = sc->low_freq_factor, hi = sc->high_freq_factor;
    double old_ctx = sc->original_max_position;
    double low_freq_wavelen = old_ctx / lo, high_freq_wavelen = old_ctx / hi;
    for (int i = 0; i < rot / 2; i++) {
        double f = inv_freq[i];
        double wavelen = 2.0 * M_PI / f;
        if (wavelen > low_freq_wavelen) {
            f = f / factor;
        } else if (!(wavelen < high_freq_wavelen)) {
            double smooth = (old_ctx / wavelen - lo) / (hi - lo);
            f = (1.0 - smooth) * f / factor + smooth * f;
        }
        inv_freq[i] = (float)f;
    }
}

/* YaRN's attention scale for a context-extension factor. */
static double yarn_get_mscale(double scale, double mscale) {
    if (scale <= 1.0)
        return 1.0;
    return 0.1 * mscale * log(scale) + 1.0;
}

/* The dimension (of rot) at which a frequency turns num_rotations times over
 * the original context. */
static double yarn_correction_dim(double num_rotations, int rot, double theta, double max_pos) {
    return (rot * log(max_pos / (num_rotations * 2.0 * M_PI))) / (2.0 * log(theta));
}

/* YaRN: frequencies below the beta_slow correction dimension are divided by
 * factor, those above beta_fast are kept, with a linear ramp in between (the
 * correction range truncated to whole dimensions, transformers' default).
 * factor is used as given; transformers versions differ on whether a config
 * with original_max_position_embeddings takes max_position_embeddings /
 * original_max_position_embeddings instead, so the config reader decides. */
static void yarn_inv_freq(float *inv_freq, float *mscale, int rot, double theta,
                          const rope_scaling_t *sc) {
    double factor = sc->factor;
    double beta_fast = sc->beta_fast != 0.0f ? sc->beta_fast : 32.0;
    double beta_slow = sc->beta_slow != 0.0f ? sc->beta_slow : 1.0;
    double max_pos = sc->original_max_position;
    double attention_factor = sc->attention_factor;
    if (attention_factor == 0.0) {
        if (sc->mscale != 0.0f && sc->mscale_all_dim != 0.0f)
            attention_factor =
                yarn_get_mscale(factor, sc->mscale) / yarn_get_mscale(factor, sc->mscale_all_dim);
        else
            attention_factor = yarn_get_mscale(factor, 1.0);
    }
    double low = floor(yarn_correction_dim(beta_fast, rot, theta, max_pos));
    double high = ceil(yarn_correction_dim(beta_slow, rot, theta, max_pos));
    if (low < 0.0)
        low = 0.0;
    if (high > rot - 1)
        high = rot - 1;
    if (low == high)
        high += 0.001; /* avoids a zero-width ramp */
    for (int i = 0; i < rot / 2; i++) {
        double pos_freq = pow(theta, (double)(2 * i) / rot);
        double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (factor * pos_freq);
        double ramp = ((double)i - low) / (high - low);
        ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
        double extrapolation_factor = 1.0 - ramp;
        inv_freq[i] = (float)(interpolation * (1.0 - extrapolation_factor) +
                              extrapolation * extrapolation_factor);
    }
    *mscale = (float)attention_factor;
}

static int check_scaling(const rope_scaling_t *sc) {
    if (sc->type != ROPE_LINEAR && sc->type != ROPE_LLAMA3 && sc->type != ROPE_YARN)
        return mo_errorf(MO_EINVAL, "rope_scaling: unknown type %d", (int)sc->type);
    if (!(sc->factor > 0.0f) || !isfinite(sc->factor))
        return mo_errorf(MO_EINVAL, "rope_scaling.factor must be > 0 (got %g)", sc->factor);
    if (sc->type == ROPE_LINEAR)
        return MO_OK;
    if (sc->original_max_position <= 0)
        return mo_errorf(MO_EINVAL,
                         "rope_scaling.original_max_position_embeddings must be > 0 (got %d)",
                         sc->original_max_position);
    if (sc->type == ROPE_LLAMA3) {
        if (!(sc->low_freq_factor > 0.0f))
            return mo_errorf(MO_EINVAL, "rope_scaling.low_freq_factor must be > 0 (got %g)",
                             sc->low_freq_factor);
        if (!(sc->low_freq_factor < sc->high_freq_factor))
            return mo_errorf(
                MO_EINVAL, "rope_scaling.low_freq_factor (%g) must be below high_freq_factor (%g)",
                sc->low_freq_factor, sc->high_freq_factor);
        return MO_OK;
    }
    if (!(sc->beta_fast >= 0.0f) || !(sc->beta_slow >= 0.0f))
        return mo_errorf(MO_EINVAL, "rope_scaling.beta_fast/beta_slow must be >= 0 (got %g, %g)",
                         sc->beta_fast, sc->beta_slow);
    double bf = sc->beta_fast != 0.0f ? sc->beta_fast : 32.0;
    double bs = sc->beta_slow != 0.0f ? sc->beta_slow : 1.0;
    if (bf < bs)
        return mo_errorf(MO_EINVAL, "rope_scaling.beta_fast (%g) must not be below beta_slow (%g)",
                         bf, bs);
    if (!(sc->mscale >= 0.0f) || !(sc->mscale_all_dim >= 0.0f))
        return mo_errorf(MO_EINVAL, "rope_scaling.mscale/mscale_all_dim must be >= 0 (got %g, %g)",
                         sc->mscale, sc->mscale_all_dim);
    if (!(sc->attention_factor >= 0.0f))
        return mo_errorf(MO_EINVAL, "rope_scaling.attention_factor must be >= 0 (got %g)",
                         sc->attention_factor);
    return MO_OK;
}

int rope_init(float *inv_freq, float *mscale, int rot, float theta, const rope_scaling_t *sc) {
    if (rot <= 0 || rot % 2 != 0)
        return mo_errorf(MO_EINVAL, "rope: rotary dimension must be even and > 0 (got %d)", rot);
    if (!(theta > 1.0f) || !isfinite(theta))
        return mo_errorf(MO_EINVAL, "rope_theta must be > 1 (got %g)", theta);
    if (sc && sc->type != ROPE_DEFAULT)
        TRY(check_scaling(sc));
    *mscale = 1.0f;
    if (sc && sc->type == ROPE_YARN) {
        yarn_inv_freq(inv_freq, mscale, rot, theta, sc);
        return MO_OK;
    }
    default_inv_freq(inv_freq, rot, theta);
    if (sc && sc->type == ROPE_LINEAR) {
        for (int i = 0; i < rot / 2; i++)
            inv_freq[i] /= sc->factor;
    } else if (sc && sc->type == ROPE_LLAMA3) {
        llama3_inv_freq(inv_freq, rot, sc);
    }
    return MO_OK;
}
