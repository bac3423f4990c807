/* config_schema: the table of every configuration key (name, type, bounds,
 * default, field, doc). Parsing, validation, dump and docs all read it. */
#include <stddef.h>
#include <stdint.h>

#include "core/config.h"

#define FIELD(sec, f) offsetof(moerl_config_t, sec.f), sizeof(((moerl_config_t *)0)->sec.f)

#define K_BOOL(sec, f, def, doc)                                                                   \
    { #sec, #f, CFG_BOOL, FIELD(sec, f), 0, 0, 0, 0, 0, NULL, def, doc }
#define K_INT(sec, f, lo, hi, def, doc)                                                            \
    { #sec, #f, CFG_INT, FIELD(sec, f), lo, hi, 0, 0, 0, NULL, def, doc }
#define K_FLOAT(sec, f, lo, hi, flags, def, doc)                                                   \
    { #sec, #f, CFG_FLOAT, FIELD(sec, f), 0, 0, lo, hi, flags, NULL, def, doc }
#define K_STR(sec, f, type, flags, def, doc)                                                       \
    { #sec, #f, type, FIELD(sec, f), 0, 0, 0, 0, flags, NULL, def, doc }
#define K_ENUM(sec, f, names, def, doc)                                                            \
    { #sec, #f, CFG_ENUM, FIELD(sec, f), 0, 0, 0, 0, 0, names, def, doc }
#define K_LIST(sec, f, names, def, doc)                                                            \
    { #sec, #f, CFG_STRLIST, FIELD(sec, f), 0, 0, 0, 0, 0, names, def, doc }

#define OPEN_LO CFG_MIN_OPEN
#define OPEN_HI CFG_MAX_OPEN
#define TOKENS_MAX ((int64_t)1 << 40)
#define INT_BIG 1000000000

static const char *const device_names[] = {"cpu", "cuda", NULL};
static const char *const dtype_names[] = {"auto", "bf16", "f32", NULL};
static const char *const advantage_names[] = {"grpo", "dr_grpo", "rloo", "reinforce", NULL};
static const char *const loss_names[] = {"ppo", "gspo", "cispo", NULL};
static const char *const loss_agg_names[] = {"token-mean", "seq-mean-token-sum",
                                             "seq-mean-token-mean", NULL};
static const char *const kl_names[] = {"k1", "k2", "k3", NULL};
static const char *const schedule_names[] = {"constant", "cosine", NULL};
static const char *const overlong_names[] = {"keep", "filter", "penalty", NULL};
static const char *const task_names[] = {"arith", "sort", "jsonl", NULL};
static const char *const comm_names[] = {"mpi", "nccl", NULL};

const char *const cfg_lora_targets[] = {
    "q_proj",   "k_proj",         "v_proj",    "o_proj",    "q_a_proj",  "q_b_proj",
    "kv_a_proj_with_mqa",         "kv_b_proj", "gate_proj", "up_proj",   "down_proj",
    "experts",  "shared_experts", "dense_mlp", NULL};

const cfg_section_t cfg_sections[] = {
    {"run", "The run as a whole: name, directory, seed, threads and device."},
    {"model", "The frozen base model and how the policy forward and backward treat it."},
    {"lora", "The trainable low-rank adapters on the frozen base."},
    {"rollout", "Generation: the rollout workers, sampling and the KV cache."},
    {"reward", "Scoring of completions: the reward workers and the reward function."},
    {"learner", "The RL update: advantages, policy loss, optimizer, off-policy control, "
                "checkpoints and expert-parallel ranks."},
    {"data", "The prompt stream."},
    {"transport", "ZeroMQ endpoints, message limits, liveness and CURVE security."},
    {"metrics", "Progress reporting: Prometheus endpoint, JSON lines and the terminal line."},
};
const int cfg_nsections = (int)(sizeof cfg_sections / sizeof cfg_sections[0]);

const cfg_key_t cfg_keys[] = {
    /* run */
    K_STR(run, name, CFG_STRING, CFG_NONEMPTY, "moerl",
          "Run name, used in logs, metrics and checkpoint metadata."),
    K_STR(run, dir, CFG_PATH, 0, "",
          "Run directory for checkpoints, metrics and logs; empty means runs/<run.name>."),
    K_INT(run, seed, 0, INT64_MAX, "1234",
          "Master seed; every random stream (init, sampling, shuffling) derives from it."),
    K_INT(run, threads, 0, 4096, "0", "CPU threads per process; 0 uses every core."),
    K_ENUM(run, device, device_names, "cpu",
           "Device for the models: cuda runs the learner's training step and scoring, and the "
           "rollout workers' prefill, decode and sampling, on the GPU (builds with the CUDA "
           "backend; see the checks across keys)."),
    K_BOOL(run, deterministic, "false",
           "Bit-reproducible runs: fixed reduction orders and one CPU thread per reduction "
           "(slower)."),

    /* model */
    K_STR(model, path, CFG_PATH, 0, "",
          "Hugging Face model directory (config.json, safetensors, tokenizer); required to run."),
    K_ENUM(model, dtype, dtype_names, "auto",
           "Storage of the frozen base weights; auto keeps the checkpoint's dtype (bf16, or fp8 "
           "with block scales)."),
    K_BOOL(model, recompute, "false",
           "Recompute layer activations during backward instead of keeping them (less memory, "
           "more compute)."),
    K_BOOL(model, routing_replay, "true",
           "The learner replays the experts each token was routed to during rollout."),
    K_INT(model, max_seq_len, 16, 1048576, "2048",
          "Longest sequence (prompt plus completion) in tokens."),

    /* lora */
    K_INT(lora, rank, 1, 4096, "16", "Adapter rank R."),
    K_FLOAT(lora, alpha, 0, 1e6, OPEN_LO, "32",
            "Adapter scale numerator: the update is scaled by alpha / rank."),
    K_LIST(lora, targets, cfg_lora_targets, "q_proj,k_proj,v_proj,o_proj",
           "Modules that get adapters: attention projections (q_proj k_proj v_proj o_proj; "
           "for MLA models q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj), MLP "
           "projections by name "
           "(gate_proj, up_proj, down_proj in every MLP), or whole MLP kinds (experts: every "
           "routed expert; shared_experts; dense_mlp: the dense layers)."),
    K_BOOL(lora, rslora, "false", "rsLoRA: scale by alpha / sqrt(rank) instead of alpha / rank."),
    K_FLOAT(lora, dropout, 0, 0, 0, "0",
            "Adapter dropout; must be 0: dropout is not supported, as it would make the "
            "rollout's and the learner's logprobs differ."),
    K_INT(lora, init_seed, 0, INT64_MAX, "0",
          "Seed for the initial A matrices (B starts at zero); 0 derives it from run.seed."),
    K_BOOL(lora, train_router, "false",
           "Also train every MoE layer's router weight (mlp.gate, (E, D)) in full, as an f32 "
           "copy next to the adapters: optimised, clipped, checkpointed and published with "
           "them, and saved as PEFT modules_to_save; replicated on every rank with expert "
           "parallelism. moerl sft trains it too."),
    K_BOOL(lora, train_norms, "false",
           "Also train the RMSNorm weights in full (input_layernorm, post_attention_layernorm, "
           "Qwen3's q_norm and k_norm, MLA's q_a_layernorm and kv_a_layernorm, the final "
           "norm), as f32 copies next to the adapters, like lora.train_router; "
           "learner.weight_decay does not apply to them."),

    /* rollout */
    K_INT(rollout, workers, 1, 1024, "1", "Rollout worker processes."),
    K_INT(rollout, group_size, 1, 4096, "8", "Completions per prompt (G)."),
    K_INT(rollout, prompts_per_step, 1, 1048576, "16", "Prompts per learner step."),
    K_INT(rollout, max_new_tokens, 1, 1048576, "512", "Most tokens generated per completion."),
    K_FLOAT(rollout, temperature, 0, 10, OPEN_LO, "1", "Sampling temperature."),
    K_FLOAT(rollout, top_p, 0, 1, OPEN_LO, "1", "Nucleus sampling mass; 1 is off."),
    K_INT(rollout, top_k, 0, 1048576, "0", "Sample among the k most likely tokens; 0 is off."),
    K_FLOAT(rollout, min_p, 0, 1, OPEN_HI, "0",
            "Drop tokens below min_p times the top probability; 0 is off."),
    K_LIST(rollout, stop_strings, NULL, "",
           "Generation stops after any of these strings (end-of-sequence always stops)."),
    K_INT(rollout, kv_cache_tokens, 0, TOKENS_MAX, "0",
          "KV cache budget in tokens per worker; 0 sizes it to max_batch * model.max_seq_len."),
    K_INT(rollout, max_batch, 1, 65536, "64", "Most sequences decoded together per worker."),
    K_STR(rollout, prompt_template, CFG_STRING, 0, "{prompt}",
          "Text around each prompt; {prompt} (exactly once) is replaced by the prompt."),
    K_BOOL(rollout, merge_adapter, "false",
           "Merge the adapter into a copy of the adapted base weights for generation (faster "
           "decode, more memory)."),
    K_BOOL(rollout, cuda_graphs, "false",
           "With run.device cuda: record each decode step's shape once as a CUDA graph and "
           "replay it (rows padded to a few sizes), one launch per step instead of one per "
           "kernel."),
    K_BOOL(rollout, packed_weights, "true",
           "On CPUs with AMX tiles, keep a copy of the bf16 weights in the tiles' layout "
           "(faster generation, one more copy of those weights in memory)."),
    K_BOOL(rollout, record_prompt_routing, "false",
           "Also record the experts chosen for prompt tokens, so replay covers the whole "
           "sequence."),

    /* reward */
    K_INT(reward, workers, 1, 1024, "1", "Reward worker processes."),
    K_STR(reward, function, CFG_STRING, CFG_NONEMPTY, "arith_exact",
          "Reward spec (docs/rewards.md): built-ins and weighted sums such as "
          "\"0.8*numeric+0.2*format:pattern=...\"; with reward.plugin set, the plugin's "
          "argument string."),
    K_STR(reward, plugin, CFG_PATH, 0, "",
          "Reward plugin (a shared library with the moerl_reward.h ABI); empty uses the "
          "built-in functions."),
    K_INT(reward, timeout_ms, 1, 3600000, "10000",
          "Time limit for scoring one group; a group past it scores as failed."),

    /* learner */
    K_INT(learner, steps, 1, INT_BIG, "100", "Learner steps (policy updates) in the run."),
    K_ENUM(learner, advantage, advantage_names, "grpo",
           "Advantage estimator: group mean and std (grpo), group mean only (dr_grpo), "
           "leave-one-out mean (rloo), batch-mean baseline (reinforce)."),
    K_ENUM(learner, loss, loss_names, "ppo",
           "Policy loss: token-level clipped ratio (ppo), sequence-level clipped ratio (gspo), "
           "clipped importance weight on a REINFORCE term (cispo)."),
    K_ENUM(learner, loss_agg, loss_agg_names, "token-mean",
           "How per-token losses combine into the batch loss."),
    K_FLOAT(learner, clip_low, 0, 1, OPEN_HI, "0.2",
            "Lower clip: ratios below 1 - clip_low are clipped."),
    K_FLOAT(learner, clip_high, 0, 10, 0, "0.28",
            "Upper clip: ratios above 1 + clip_high are clipped (clip-higher when > clip_low)."),
    K_FLOAT(learner, kl_coef, 0, 100, 0, "0",
            "Weight of the KL penalty to the base model (adapters off); 0 skips the reference "
            "forward."),
    K_ENUM(learner, kl_estimator, kl_names, "k3", "KL estimator of the penalty."),
    K_FLOAT(learner, entropy_coef, 0, 10, 0, "0", "Weight of the entropy bonus; 0 is off."),
    K_FLOAT(learner, lr, 0, 1, OPEN_LO, "1e-5", "Peak learning rate of AdamW."),
    K_ENUM(learner, lr_schedule, schedule_names, "constant",
           "Learning-rate schedule after warmup."),
    K_INT(learner, warmup_steps, 0, INT_BIG, "0", "Linear warmup steps from 0 to lr."),
    K_FLOAT(learner, min_lr_ratio, 0, 1, 0, "0.1",
            "Cosine schedule: the final learning rate as a fraction of lr."),
    K_FLOAT(learner, weight_decay, 0, 1, 0, "0",
            "AdamW decoupled weight decay (not on the norm weights lora.train_norms trains)."),
    K_FLOAT(learner, beta1, 0, 1, OPEN_HI, "0.9", "AdamW first-moment decay."),
    K_FLOAT(learner, beta2, 0, 1, OPEN_HI, "0.999", "AdamW second-moment decay."),
    K_FLOAT(learner, adam_eps, 0, 1, OPEN_LO, "1e-8", "AdamW denominator epsilon."),
    K_FLOAT(learner, grad_clip, 0, 1e6, 0, "1", "Global gradient-norm clip; 0 is off."),
    K_INT(learner, ppo_epochs, 1, 100, "1", "Passes over each step's batch."),
    K_INT(learner, minibatches, 1, 65536, "1",
          "Optimizer updates per pass; the batch splits into this many minibatches."),
    K_INT(learner, micro_batch_tokens, 1, TOKENS_MAX, "8192",
          "Tokens per forward/backward chunk; gradients accumulate over chunks."),
    K_INT(learner, max_staleness, 0, 1000, "1",
          "Most policy versions a sample may lag behind the learner; 0 is strictly on-policy."),
    K_FLOAT(learner, tis_cap, 0, 1e6, 0, "2",
            "Truncated importance sampling: cap on the learner/rollout probability ratio; 0 is "
            "off."),
    K_BOOL(learner, dynamic_sampling, "false",
           "Drop groups whose rewards are all equal (zero advantage) and refill the batch."),
    K_ENUM(learner, overlong, overlong_names, "keep",
           "Completions cut at max_new_tokens: train on them, drop them, or add a length "
           "penalty."),
    K_INT(learner, overlong_buffer, 0, 1048576, "256",
          "Penalty mode: tokens before rollout.max_new_tokens over which the penalty ramps "
          "from 0 to -1."),
    K_FLOAT(learner, mismatch_kl_max, 0, 1e6, 0, "0",
            "Skip sequences whose rollout-vs-learner KL exceeds this; 0 is off."),
    K_INT(learner, checkpoint_every, 0, INT_BIG, "50",
          "Steps between checkpoints; 0 saves only at the end."),
    K_INT(learner, keep_checkpoints, 0, 1000000, "3", "Checkpoints kept on disk; 0 keeps all."),
    K_INT(learner, ranks, 1, 4096, "1", "Expert-parallel learner ranks."),
    K_ENUM(learner, comm, comm_names, "mpi",
           "With learner.ranks > 1 and run.device cuda: how the ranks' MoE layers exchange "
           "rows, over MPI staged through host memory (mpi) or between the GPUs' memory "
           "over NCCL (nccl, one GPU per rank)."),

    /* data */
    K_ENUM(data, task, task_names, "arith",
           "Prompt source: built-in arithmetic or sorting tasks, or a JSONL file."),
    K_STR(data, path, CFG_PATH, 0, "",
          "JSONL file of {\"prompt\": ..., \"answer\": ...} records; required for task jsonl."),
    K_INT(data, arith_min_digits, 1, 9, "1",
          "Task arith: fewest digits of an operand (1 allows 0-9); each operand is uniform "
          "over the numbers of min..max digits, so every problem is equally likely."),
    K_INT(data, arith_max_digits, 1, 9, "3",
          "Task arith: most digits of an operand; at least data.arith_min_digits."),
    K_STR(data, arith_ops, CFG_STRING, CFG_NONEMPTY, "+-",
          "Task arith: operators to draw from, each of + - * at most once (\"+\": addition "
          "only)."),
    K_INT(data, eval_size, 0, INT_BIG, "64", "Prompts held out for evaluation."),
    K_BOOL(data, shuffle, "true", "Shuffle prompts each epoch (seeded by run.seed)."),
    K_BOOL(data, skip_malformed, "false",
           "Skip malformed JSONL records (counted and logged) instead of failing."),

    /* transport */
    K_STR(transport, control, CFG_ENDPOINT, 0, "tcp://127.0.0.1:5570",
          "Learner control socket: registration, heartbeats, moerl ctl."),
    K_STR(transport, work, CFG_ENDPOINT, 0, "tcp://127.0.0.1:5571",
          "Prompt leases to rollout workers."),
    K_STR(transport, trajectories, CFG_ENDPOINT, 0, "tcp://127.0.0.1:5572",
          "Scored trajectories into the learner."),
    K_STR(transport, weights, CFG_ENDPOINT, 0, "tcp://127.0.0.1:5573",
          "Adapter versions published to rollout workers."),
    K_STR(transport, reward, CFG_ENDPOINT, 0, "tcp://127.0.0.1:5574",
          "Groups to score, to the reward workers."),
    K_INT(transport, max_msg_bytes, 4096, TOKENS_MAX, "268435456",
          "Largest message accepted; bigger ones are dropped as malformed."),
    K_INT(transport, heartbeat_ms, 10, 600000, "1000",
          "Heartbeat interval; a peer is dead after 3 missed beats."),
    K_INT(transport, lease_timeout_ms, 100, 86400000, "60000",
          "A prompt lease not returned in this time is handed out again."),
    K_STR(transport, curve_secret_key, CFG_PATH, 0, "",
          "File with this process's CURVE secret key (z85); empty disables CURVE."),
    K_STR(transport, curve_public_key, CFG_PATH, 0, "",
          "File with this process's CURVE public key (z85)."),
    K_STR(transport, curve_server_key, CFG_PATH, 0, "",
          "File with the server's CURVE public key, for connecting sockets."),
    K_BOOL(transport, allow_insecure_remote, "false",
           "Allow endpoints beyond loopback without CURVE keys."),
    K_STR(transport, curve_allowed_clients, CFG_PATH, 0, "",
          "CURVE client allow-list for bound sockets: a file of public keys (z85, one a line) or "
          "a directory of *.pub files; empty admits any client holding the server key."),
    K_INT(transport, learner_timeout_ms, 0, 86400000, "0",
          "A welcomed worker that hears nothing from the learner this long exits with an "
          "error; 0 means 10 heartbeat intervals."),

    /* metrics */
    K_INT(metrics, http_port, 0, 65535, "0", "Port of the Prometheus text endpoint; 0 is off."),
    K_BOOL(metrics, jsonl, "true",
           "Write metrics as JSON lines to <run dir>/metrics/<daemon>.jsonl."),
    K_BOOL(metrics, status_line, "true", "Print a one-line status on the terminal."),
};
const int cfg_nkeys = (int)(sizeof cfg_keys / sizeof cfg_keys[0]);
