"""The speed check of the accelerator check (`--speed`, issue 33): what one GRPO step's
pieces cost on the device, each beside its torch peer, in priority order under the budget.

Per model (qwen2.5-0.5b first: the target's model), in this order: the decode step at 64
rows with both layer loops (decode_parts.py), the packed train step and the HF + torch
step on the same samples, the sampler's generate() (the scan), HF generate on the same
prompts, generate() with unrolled layers and bucketed slots (it compiles one decode
program per KV bound, each longer: last), the unpacked train step. Then, for the first
model: the decode step at the larger row counts, the train step with each remat policy and
with the head chunk sized for the device, and the decode step under XLA flags that put
while loops into command buffers (CUDA graphs). The first model's decode-step and packed
train tasks also trace one call under the jax profiler ("decode trace" / "train trace"
rows: device busy share, gaps, kernels per step and per layer-step, the top kernels;
experiments.common.trace). A task the budget cannot start becomes a "skipped"
row.

`peer_ratios` gives every Tandem row of the JSON its ratio to the torch row of the same
samples (computed when the results are written; the JSON-lines stream keeps the rows as
they came): train vs_torch_per_sample = torch step s / ours (same samples: ours packed or
not); sampler vs_hf_generate = our tokens/s / HF's; decode step vs_hf_generate_step = HF's
ms per step / ours (same rows as the HF run: groups x group_size).
"""
from __future__ import annotations

DP, MP, TORCH = ("experiments.bench.accelerator.decode_parts",
                 "experiments.bench.accelerator.model_parts",
                 "experiments.bench.accelerator.torch_parts")
SPEED_PARTS = ("decode_step", "train", "torch", "sampler")
DECODE_TARGET_TOKENS_PER_S = 50_000.0  # qwen2.5-0.5b at 64 rows (issue 33)
# XLA GPU: while loops and conditionals captured into command buffers (CUDA graphs) too
COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
                        "CUDNN,WHILE,CONDITIONAL")

SPEED_FULL = dict(models=("qwen2.5-0.5b", "smollm2-135m"), decode_rows=(64, 256),
                  group_size=8, decode_prompt=256, decode_steps=64, copy_mb=1024,
                  train=(8, 8, 256, 256), sampler=(8, 8, 256, 256), seconds=1.0,
                  remat=("dots", "full"), command_buffer_flags=COMMAND_BUFFER_FLAGS)
SPEED_SMOKE = dict(models=("tiny",), decode_rows=(4, 8), group_size=2, decode_prompt=6,
                   decode_steps=5, copy_mb=16, train=(2, 2, 6, 5), sampler=(2, 2, 6, 5),
                   seconds=0.05, remat=("full",), command_buffer_flags=None)


# the torch peer's process: JAX kept off the accelerator there (its default preallocation
# took the memory the torch step then ran out of, on the H100), and no preallocation if it
# is touched at all
TORCH_ENV = {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _task(part, item, fn, cap_s, env=None, **args):
    task = {"part": part, "item": item, "fn": fn, "args": args, "cap_s": cap_s}
    if env:
        task["env"] = env
    return task


def plan_speed_tasks(parts, sz: dict, platform: str, peak) -> list[dict]:
    """The speed check's tasks in priority order (see the module docstring)."""
    gpu = platform == "gpu"
    cap = (lambda s: s) if gpu else (lambda s: max(300, 2 * s))  # noqa: E731 - CPU: slower
    g, n, p, r = sz["train"]
    sg, sn, sp, sr = sz["sampler"]
    tasks = []

    def decode(model, rows, loops, env=None, tag="", trace=False):
        tasks.append(_task("decode_step", f"{model} rows={rows} {'+'.join(loops)}{tag}",
                           f"{DP}:decode_step", cap(150), env=env, model=model, rows=[rows],
                           group_size=sz["group_size"], prompt=sz["decode_prompt"],
                           steps=sz["decode_steps"], layer_loops=list(loops),
                           seconds=sz["seconds"], copy_mb=sz["copy_mb"],
                           xla_flags=(env or {}).get("XLA_FLAGS"), trace=trace))

    def train(model, packed, remat=None, head_chunk="default", trace=False):
        item = (f"{model} {'packed' if packed else 'unpacked'} remat={remat or 'none'}"
                f"{' chunk=device' if head_chunk == 'device' else ''}")
        tasks.append(_task("train", item, f"{MP}:train", cap(90), model=model, groups=g,
                           group_size=n, prompt=p, response=r, packed=packed, attn_impl=None,
                           peak_tflops=peak, remat=remat, head_chunk=head_chunk,
                           trace=trace))

    def sampler(model, loop, bucket):
        tasks.append(_task("sampler", f"{model} {loop}", f"{MP}:sampler", cap(90), model=model,
                           groups=sg, group_size=sn, prompt=sp, response=sr, layer_loop=loop,
                           bucket_slots=bucket))

    for model in sz["models"]:
        first_model = model == sz["models"][0]   # its decode and train rows carry a trace
        if "decode_step" in parts:
            decode(model, sz["decode_rows"][0], ("scan", "unrolled"), trace=first_model)
        if "train" in parts:
            train(model, True, trace=first_model)
        if "torch" in parts:
            tasks.append(_task("torch", f"{model} train", f"{TORCH}:train", cap(120),
                               env=TORCH_ENV, model=model, groups=g, group_size=n, prompt=p,
                               response=r, peak_tflops=peak))
        if "sampler" in parts:
            sampler(model, "scan", False)
        if "torch" in parts:
            tasks.append(_task("torch", f"{model} generate", f"{TORCH}:generate", cap(150),
                               env=TORCH_ENV, model=model, groups=sg, group_size=sn, prompt=sp,
                               response=sr))
        if "sampler" in parts:  # unrolled: one compile per kv bound, each longer
            sampler(model, "unrolled", True)
        if "train" in parts:
            train(model, False)
    first = sz["models"][0]
    if "decode_step" in parts:
        for rows in sz["decode_rows"][1:]:
            decode(first, rows, ("unrolled",))
    if "train" in parts:
        for remat in sz["remat"]:
            train(first, True, remat=remat)
        if platform != "cpu":  # a CPU reports no memory: its "device" chunk is the default
            train(first, True, head_chunk="device")
    if "decode_step" in parts and gpu and sz["command_buffer_flags"]:
        decode(first, sz["decode_rows"][0], ("scan", "unrolled"),
               env={"XLA_FLAGS": sz["command_buffer_flags"]}, tag=" command buffers")
    return tasks


def _same_samples(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("model", "groups", "group_size", "P", "R"))


def peer_ratios(rows: list[dict]) -> list[dict]:
    """Copies of `rows`, each ok Tandem train / sampler / decode-step row with its ratio to
    the ok torch row of the same samples (see the module docstring); others unchanged."""
    ok = [x for x in rows if x.get("status") == "ok"]
    torch_train = [x for x in ok if x.get("part") == "torch" and x.get("kind") == "train"]
    hf_gen = [x for x in ok if x.get("part") == "torch" and x.get("kind") == "generate"]
    out = []
    for row in rows:
        row = dict(row)
        if row.get("status") == "ok" and row.get("part") == "train" and "step_s" in row:
            peer = next((t for t in torch_train if _same_samples(row, t)), None)
            if peer is not None:
                row["vs_torch_per_sample"] = round(peer["step_s"] / row["step_s"], 3)
        elif row.get("status") == "ok" and row.get("part") == "sampler":
            peer = next((t for t in hf_gen if _same_samples(row, t)), None)
            if peer is not None:
                row["vs_hf_generate"] = round(row["tokens_per_s"] / peer["tokens_per_s"], 3)
        elif row.get("status") == "ok" and row.get("kind") == "decode step":
            peer = next((t for t in hf_gen if t["model"] == row["model"]
                         and t["groups"] * t["group_size"] == row["rows"]), None)
            if peer is not None:
                row["vs_hf_generate_step"] = round(peer["ms_per_step"] / row["ms_per_step"], 3)
        out.append(row)
    return out


def speed_headline(rows: list[dict], machine: str, smoke: bool) -> dict:
    """Decode tokens/s of the first model at the first row count, the best layer loop
    (qwen2.5-0.5b at 64 rows; --smoke: tiny at 4), against issue 33's 50k tokens/s."""
    sz = SPEED_SMOKE if smoke else SPEED_FULL
    model, n_rows = sz["models"][0], sz["decode_rows"][0]
    best = max((x["tokens_per_s"] for x in rows if x.get("status") == "ok"
                and x.get("kind") == "decode step" and x.get("model") == model
                and x.get("rows") == n_rows and not x.get("xla_flags")), default=0.0)
    return {"metric": f"decode tokens/s, {model}, {n_rows} rows, bf16, best layer loop",
            "value": best, "target": DECODE_TARGET_TOKENS_PER_S, "machine": machine}
