/* step_flops: the FLOPs of one training step of the policy model, counted on the model. */
#include "bench/step_flops.h"

#include "lora/adapter.h"

void step_flops(const model_t *m, const lora_adapter_t *ad, const int32_t *pos, int T,
                double *fwd, double *bwd) {
    double qd = (double)m->H * m->Dh, kvd = (double)m->Hkv * m->Dh, D = m->D;
    double p_mm = (double)m->V * D, attn = 0.0;
    for (int l = 0; l < m->L; l++) {
        const model_layer_t *ly = &m->layers[l];
        p_mm += D * qd * 2 + D * kvd * 2;
        if (ly->moe)
            p_mm += D * m->E + (double)m->K * 3 * D * ly->moe_cfg.F +
                    3 * D * (double)ly->moe_cfg.n_shared * ly->moe_cfg.F;
        else
            p_mm += 3 * D * m->cfg.intermediate_size;
        double ctx = 0.0;
        for (int t = 0; t < T; t++) {
            double c = pos[t] + 1.0;
            ctx += ly->window > 0 && c > ly->window ? ly->window : c;
        }
        attn += 4.0 * qd * ctx;
    }
    double lora = 0.0;
    for (int e = 0; ad && e < ad->n_entries; e++) {
        const lora_entry_t *en = &ad->entries[e];
        double rows = en->kind == LORA_KIND_EXPERT ? (double)T * m->K / m->E : T;
        lora += 2.0 * en->R * (en->C + en->OC) * rows;
    }
    *fwd = 2.0 * T * p_mm + attn + lora;
    *bwd = 2.0 * T * p_mm + 2.0 * attn + 2.0 * lora;
}
