# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real-engine validation of KV checksums on one CUDA GPU (NIXL pull P/D).

Five vLLM engines run as separate processes on one GPU, each with the
NixlConnector (kv_both) and this package loaded through its entry point:

- ``ref``: checksums off (the reference; plain greedy decoding),
- ``producer``: checksums on,
- ``consumer``: checksums on, fail-closed, kv_load_failure_policy "recompute",
- ``faulty``: like ``consumer`` plus the operator fault injector (R131),
- ``consumer_off``: checksums off, the control for ``consumer``.
- ``contained`` / ``uncontained`` (``containment`` phase only): fail-open
  consumers with the fault injector at rate 1.0 (``zero_block``); the second
  runs with ``KV_CHECKSUM_TEST_NO_CONTAINMENT=1`` (checksums and the injector
  on, containment of failed loads off: R138's control).

Phases (each prompt is sent on its own, so that every engine runs the same
shapes and greedy outputs are comparable bit for bit; the batched rounds after
them add concurrency and measure the numerical noise floor of batching):
1. equality: the same producer-mode requests (do_remote_decode, greedy) on
   ``ref`` and ``producer``: token ids must be identical; the producer runs
   with ``VLLM_GPU_SYNC_CHECK=error`` (any host sync fails the engine).
   Batched: 25 at a time on ``ref`` twice and on ``producer`` (reported).
2. pd: prompts prefilled on ``producer``, decoded on ``consumer`` after a NIXL
   pull, one per launch and then 25 at a time (``--pd-batch``; new prompts): no
   mismatch or
   unverified load may be logged, every request must load KV, and the same
   loads through ``consumer_off`` must give the same outputs (`pd_outputs_ok`).
   Equality with ``ref``'s greedy output computed the same way (``ref`` runs
   every prompt twice, fresh and then from its prefix cache, see
   `single_engine`) is reported: a consumer computes the last prompt token
   over loaded KV, which can part from a single engine with checksums off too.
3. faults: the same through ``faulty``: every injected fault must be reported
   as a mismatch (log lines matched one to one) and every such request
   recomputed with an output equal to ``ref``'s fresh prefill.
4. containment (not in the default ``--phases``; see `containment_phase`): a
   prompt is loaded into ``contained`` and corrupted at a block position P
   (fail-open: the request runs on it), then the same prompt is sent to the
   same consumer as a normal local request: it must hit only blocks 0..P-1
   and its output must equal ``ref``'s for that prefix split. The same on
   ``uncontained`` shows the spread: the second request hits the bad block
   and its output differs from ``ref``'s.

``--overhead-only`` starts ``ref`` and ``producer`` alone (with
``--overhead-control`` also ``off_again``, a second engine with checksums off)
and times producer prefills with checksums off and on, interleaved; with
``--model 8b`` the model is an 8B-dense-shaped Llama (config from
transformers, random weights from vLLM's dummy loader, no checkpoint).

Usage (needs vLLM 0.33.0, NIXL, transformers and this package installed):
    python kv_checksum_pd_gpu.py --out DIR [--num-equality 100] [--num-pd 200]
        [--producer-tp 2 | --consumer-tp 2]   (heterogeneous TP: two GPUs)
    python kv_checksum_pd_gpu.py --out DIR --overhead-only --model 8b
    python kv_checksum_pd_gpu.py --out DIR --phases containment
    python kv_checksum_pd_gpu.py --out DIR --model hybrid --num-equality 20 \
        --num-pd 60 --num-faults 40 --fault-rate 0.5   (Mamba2 state, issue 14)
    python kv_checksum_pd_gpu.py --out DIR --model mla|qwen3next|mamba1 ...
        (MLA latent, GDN state, Mamba1 state: issue 29, `scripts/gpu_runs.sh`)
Exit code 0 only if every check passed; a JSON summary goes to DIR/summary.json.
"""

import argparse
import itertools
import json
import multiprocessing as mp
import os
import queue
import random
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_checksum_pd_connectors as pd_connectors  # noqa: E402
from kv_checksum_chaos_plan import NO_EFFECT, split_no_effect  # noqa: E402

BLOCK_SIZE = 16
MODELS = {
    "tiny": "/tmp/kv-checksum-qwen3",
    "8b": "/tmp/kv-checksum-llama-8b",
    "mamba2": "/tmp/kv-checksum-mamba2",
    "mamba2-g2": "/tmp/kv-checksum-mamba2-g2",
    "hybrid": "/tmp/kv-checksum-nemotron-h",
    "hybrid-g2": "/tmp/kv-checksum-nemotron-h-g2",
    "mla": "/tmp/kv-checksum-deepseek-mla",
    "qwen3next": "/tmp/kv-checksum-qwen3-next",
    "mamba1": "/tmp/kv-checksum-jamba",
}
MAX_MODEL_LENS = {"tiny": 4608, "8b": 8320, "mla": 4608}
GPU_UTILS = {"tiny": 0.15, "8b": 0.3, "mla": 0.15}
# Models with Mamba state (issue 14): vLLM picks their block size (attention
# pages aligned to Mamba pages, "align" cache mode with prefix caching) and
# NIXL needs the dim-first conv state layout. A P/D consumer computes the last
# prompt token from the loaded state h(N - 1), so its outputs are compared with
# a checksums-off consumer's, not with a single engine's.
HYBRID_MODELS = {"mamba2", "mamba2-g2", "hybrid", "hybrid-g2", "qwen3next", "mamba1"}
for _shape in HYBRID_MODELS:
    MAX_MODEL_LENS[_shape] = 4608
    GPU_UTILS[_shape] = 0.12
# Mamba2 layer, attention layer, Mamba2 layer, MLP layer (Nemotron-H's
# pattern letters): vLLM 0.33.0's NIXL needs an attention group (its handshake,
# `_build_fa_remote`, fails on a model with Mamba groups only).
HYBRID_PATTERN = "M*M-"
HYBRID_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
# LLM arguments a model needs on the offline bundle (no FlashMLA, no
# FlashInfer). MLA: vLLM 0.33.0 on SM90 tries FLASH_ATTN_MLA, FLASHMLA and
# FLASHINFER_MLA before TRITON_MLA; TRITON_MLA is pure Triton, takes any
# latent size (FLASH_ATTN_MLA only 576) and kernel blocks of any multiple of
# 16; its prefill runs on FlashAttention 3, which the bundle has. GDN: the
# Triton prefill (the default is FlashInfer's).
ENGINE_KWARGS: dict[str, dict[str, Any]] = {
    "mla": {
        "attention_config": {
            "backend": "TRITON_MLA",
            "mla_prefill_backend": "FLASH_ATTN",
        }
    },
    "qwen3next": {"gdn_prefill_backend": "triton"},
}
# Tiny MLA dims (DeepSeek-V3's shape, smaller): the latent cache holds
# kv_lora_rank + qk_rope_head_dim = 160 elements per token, one per layer.
# DeepSeek-V3's latent and head dimensions (vLLM's FlashAttention MLA prefill
# accepts only a few; smaller ones fail at engine start).
MLA_DIMS = dict(
    q_lora_rank=96,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
)
INJECTION = re.compile(r"KV checksum fault injection: (\w+) into request (\S+) ")
INJECTED_AT = re.compile(
    r"KV checksum fault injection: (\w+) into request \S+ group (\d+) "
    r"block position (\d+)\."
)
QUARANTINED = re.compile(r"KV checksums: quarantined (\d+) loaded blocks")
NO_CONTAINMENT_ENV = "KV_CHECKSUM_TEST_NO_CONTAINMENT"
# Added to every engine's ports, so that two drivers can share a host (one per
# GPU, `scripts/gpu_runs.sh pair`).
PARALLEL_KV_BYTES = 1 << 30  # --parallel-start: each engine's KV cache
PORT_OFFSET = int(os.environ.get("KV_CHECKSUM_PORT_OFFSET", "0"))
MISMATCH = re.compile(r"KV checksum mismatch for request (\S+?):")
UNVERIFIED = re.compile(r"KV checksums not verified: (.*)\.")
# Largest logprob gap (nats) between two greedy candidates still counted as a
# near-tie: bf16 rounding of another computation order moves this tiny model's
# logprobs by a few hundredths; a block of wrong KV moves them by far more.
NEAR_TIE = 0.1
# Logprobs kept per generated token: enough candidates that a near-tie of
# three or more tokens still shows both runs' choices.
TOP = 8


def build_model(shape: str) -> str:
    """A random-weight model made locally (no model hub); returns its folder.

    ``tiny``: a 4-layer Qwen3 with saved random weights (peaky logits).
    ``mamba2``: a 4-layer Mamba2ForCausalLM with saved random weights, one
    group (n_groups = 1: B/C replicated across TP ranks, R40), bf16;
    ``mamba2-g2``: the same with two groups (B/C sharded at TP 2).
    ``hybrid`` (``hybrid-g2``): a 4-layer NemotronHForCausalLM, Mamba2 and
    attention layers (`HYBRID_PATTERN`), one (two) Mamba2 groups, bf16.
    ``mla``: a 4-layer DeepseekV3ForCausalLM (MLA latent cache, `MLA_DIMS`),
    every layer dense (``first_k_dense_replace`` = layers: no MoE kernels).
    ``qwen3next``: a 4-layer Qwen3NextForCausalLM, GDN and attention layers
    with tiny MoE MLPs (vLLM refuses an all-dense one; needs the bundle's
    MoE kernels, ``build_bundle.sh --moe``).
    ``mamba1``: a 4-layer JambaForCausalLM, Mamba1 and attention layers
    (NIXL needs an attention group), one expert: dense MLPs, no MoE.
    ``8b``: only the config of an 8B dense Llama (32 layers, 8 KV heads of 128);
    the engines fill the weights randomly with vLLM's dummy loader.
    """
    from transformers import LlamaConfig, Qwen3Config, Qwen3ForCausalLM

    model = MODELS[shape]
    if os.path.exists(f"{model}/config.json"):
        return model
    if shape in ("mamba2", "mamba2-g2"):
        return build_mamba2(model, 2 if shape == "mamba2-g2" else 1)
    if shape in ("hybrid", "hybrid-g2"):
        return build_hybrid(model, 2 if shape == "hybrid-g2" else 1)
    if shape in STATE_AND_MLA_BUILDERS:
        return STATE_AND_MLA_BUILDERS[shape](model)
    if shape == "8b":
        LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=MAX_MODEL_LENS[shape],
            rope_theta=500000.0,
            bos_token_id=1,
            eos_token_id=2,
            torch_dtype="bfloat16",
        ).save_pretrained(model)
        return model
    config = Qwen3Config(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=MAX_MODEL_LENS[shape],
        **TINY_VOCAB,
    )
    return save_random(Qwen3ForCausalLM, config, model)


# Every tiny model's vocabulary, special tokens and weight scale (peaky logits).
TINY_VOCAB = dict(
    vocab_size=2048,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def save_random(model_class: Any, config: Any, folder: str) -> str:
    """Random weights (seed 0) of `model_class(config)`, saved in bf16."""
    import torch

    torch.manual_seed(0)
    model_class(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def build_mamba2(model: str, n_groups: int) -> str:
    """A random tiny Mamba2 (pure Mamba2 state; its SSD kernels are in the
    offline bundle, unlike Qwen3-Next's MoE and FlashInfer GDN paths)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        hidden_size=256,
        num_hidden_layers=4,
        num_heads=8,
        head_dim=64,
        n_groups=n_groups,
        state_size=16,
        expand=2,
        **TINY_VOCAB,
    )
    return save_random(Mamba2ForCausalLM, config, model)


def build_hybrid(model: str, n_groups: int) -> str:
    """A random tiny Nemotron-H: Mamba2 state and attention KV in one model
    (dense MLP, no MoE; its kernels are in the offline bundle)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        hidden_size=256,
        hybrid_override_pattern=HYBRID_PATTERN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        mamba_num_heads=8,
        mamba_head_dim=32,
        n_groups=n_groups,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=128,
        max_position_embeddings=MAX_MODEL_LENS["hybrid"],
        **TINY_VOCAB,
    )
    assert config.hybrid_override_pattern == HYBRID_PATTERN, config
    return save_random(NemotronHForCausalLM, config, model)


NUM_TINY_LAYERS = 4


def build_mla(model: str) -> str:
    """A random tiny DeepSeek-V3: MLA attention in every layer, dense MLPs."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=NUM_TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        # No routed experts and every layer before the first MoE layer: dense
        # MLPs only, and vLLM does not see a MoE model (is_moe False).
        n_routed_experts=0,
        first_k_dense_replace=NUM_TINY_LAYERS,
        max_position_embeddings=MAX_MODEL_LENS["mla"],
        **MLA_DIMS,
        **TINY_VOCAB,
    )
    return save_random(DeepseekV3ForCausalLM, config, model)


def build_qwen3next(model: str) -> str:
    """A random tiny Qwen3-Next: GDN layers, one attention layer in four
    (its default), tiny MoE MLPs in every layer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=NUM_TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=MAX_MODEL_LENS["qwen3next"],
        **TINY_VOCAB,
    )
    return save_random(Qwen3NextForCausalLM, config, model)


def build_jamba(model: str) -> str:
    """A random tiny Jamba: Mamba1 layers 0 and 2, attention layers 1 and 3,
    one expert (dense MLPs)."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=NUM_TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,  # transformers' own path, on CPU too
        max_position_embeddings=MAX_MODEL_LENS["mamba1"],
        **TINY_VOCAB,
    )
    return save_random(JambaForCausalLM, config, model)


STATE_AND_MLA_BUILDERS: dict[str, Callable[[str], str]] = {
    "mla": build_mla,
    "qwen3next": build_qwen3next,
    "mamba1": build_jamba,
}


def shutdown_engine(llm: Any) -> None:
    """End the engine core process now: left to the interpreter's exit, it can
    outlive this process and keep its output pipes (and the GPU) open."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=10)
    except Exception:
        traceback.print_exc()


def engine_main(name: str, extra: dict, port: int, log: str, cmds, results) -> None:
    """One engine process: build an LLM, then serve generate commands."""
    extra = dict(extra)
    os.environ.update(extra.pop("_env", {}))
    tensor_parallel_size = extra.pop("_tp", 1)
    block_size = extra.pop("_block_size", BLOCK_SIZE)
    shape = extra.pop("_model", "tiny")
    kv_connector = extra.pop("_connector", "NixlConnector")
    kv_role = extra.pop("_role", "kv_both")
    kv_engine_id = extra.pop("_engine_id", None)
    kv_bytes = extra.pop("_kv_bytes", None)
    model = MODELS[shape]
    if shape in HYBRID_MODELS:
        os.environ.update(HYBRID_ENV)
        block_size = None  # vLLM aligns the block size to the Mamba page
    engine_process_setup(log, port)
    sync_check = os.environ.get("KV_CHECKSUM_SYNC_CHECK", "1") == "1"
    if (
        sync_check
        and extra.get("enable_kv_checksum")
        and not extra.get("kv_checksum_fault_injection")
    ):
        os.environ["VLLM_GPU_SYNC_CHECK"] = "error"

    def build() -> Any:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        return LLM(
            model=model,
            skip_tokenizer_init=True,
            load_format="dummy" if shape == "8b" else "auto",
            enforce_eager=True,
            gpu_memory_utilization=float(
                os.environ.get("KV_CHECKSUM_GPU_UTIL", GPU_UTILS[shape])
            ),
            max_model_len=MAX_MODEL_LENS[shape],
            kv_cache_memory_bytes=kv_bytes,
            block_size=block_size,
            dtype="bfloat16",
            seed=0,
            disable_log_stats=False,
            tensor_parallel_size=tensor_parallel_size,
            async_scheduling=os.environ.get("KV_CHECKSUM_ASYNC", "1") == "1",
            **ENGINE_KWARGS.get(shape, {}),
            kv_transfer_config=KVTransferConfig(
                kv_connector=kv_connector,
                kv_role=kv_role,
                engine_id=kv_engine_id,
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            ),
        )

    def answer(llm: Any, cmd: tuple) -> tuple:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        batch = cmd[1]
        llm.request_counter = request_ids(batch)
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                detokenize=False,
                logprobs=TOP,
                extra_args={"kv_transfer_params": kvp} if kvp else None,
                # A prefill always computes the whole prompt, so a prompt
                # produced twice sends the same KV both times. Not for Mamba
                # state: vLLM's NIXL producer then keeps its last prompt token
                # (no backoff) and sends h(N) where the consumer needs h(N - 1).
                skip_reading_prefix_cache=(
                    True
                    if kvp
                    and kvp.get("do_remote_decode")
                    and shape not in HYBRID_MODELS
                    else None
                ),
            )
            for _, kvp, max_tokens in batch
        ]
        start = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _, _ in batch],
            params,
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - start
        reply = [
            {
                "tokens": list(o.outputs[0].token_ids),
                "top": top_logprobs(o.outputs[0].logprobs),
                "kvp": o.kv_transfer_params,
                "cached": o.num_cached_tokens,
            }
            for o in outs
        ]
        try:
            metrics = {
                f"{m.name}{sorted((m.labels or {}).items())}": getattr(m, "value", None)
                for m in llm.get_metrics()
                if "kv_checksum" in m.name
            }
        except Exception as e:
            metrics = {"error": repr(e)}
        metrics["elapsed_s"] = elapsed
        return reply, metrics

    serve_commands(name, build, answer, cmds, results)


def engine_process_setup(log: str, port: int) -> None:
    """An engine process writes to its own log file (not a pipe: a core left
    behind cannot hold the driver's output open) and sets its NIXL side
    channel."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)


def serve_commands(
    name: str,
    build: Callable[[], Any],
    answer: Callable[[Any, tuple], Any],
    cmds: Any,
    results: Any,
) -> None:
    """An engine process's loop: `build()` the LLM and say "ready" (or
    "error" and return), then reply `answer(llm, cmd)` to each ("gen", ...)
    command (an error reply if it raises) until ("stop",) shuts the core
    down."""
    try:
        llm = build()
    except BaseException:
        results.put((name, "error", traceback.format_exc()))
        return
    results.put((name, "ready", None))
    while True:
        cmd = cmds.get()
        if cmd[0] == "stop":
            shutdown_engine(llm)
            break
        try:
            results.put((name, "gen", answer(llm, cmd)))
        except BaseException:
            results.put((name, "error", traceback.format_exc()))


OWN_REQUEST_NUMBERS = itertools.count(10**15)


def request_ids(batch: list) -> Any:
    """The vLLM request ids of a batch, in order: the driver's own where its
    params carry one (`pd_connectors.REQUEST_ID`, taken out here), else the
    engine's next number (above the driver's). `LLM.generate` takes each id
    from `llm.request_counter` and sorts its outputs by int(id).
    """
    ids = []
    for _, kvp, _ in batch:
        chosen = kvp.pop(pd_connectors.REQUEST_ID, None) if kvp else None
        ids.append(chosen or str(next(OWN_REQUEST_NUMBERS)))
    return iter(ids)


class Engine:
    """Handle of one engine process."""

    def __init__(
        self,
        ctx: Any,
        name: str,
        extra: dict,
        port: int,
        out: str,
        target: Any = None,
    ) -> None:
        """`target(name, extra, port, log, cmds, results)` runs the engine
        (default: this driver's `engine_main`)."""
        self.name = name
        self.port = port
        self.log = os.path.join(out, f"{name}.log")
        self.cmds = ctx.Queue()
        self.results = ctx.Queue()
        self.proc = ctx.Process(
            target=target or engine_main,
            args=(name, extra, port, self.log, self.cmds, self.results),
        )
        self.proc.start()

    def wait(self, kind: str, timeout: float) -> Any:
        end = time.time() + timeout
        while time.time() < end:
            try:
                name, got, payload = self.results.get(timeout=5)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"{self.name} died; see {self.log}") from None
                continue
            if got == "error":
                raise RuntimeError(f"{self.name}: {payload}")
            if got == kind:
                return payload
        raise TimeoutError(f"{self.name}: no {kind} in {timeout}s")

    def generate(self, batch: list, timeout: float = 300) -> tuple[list, dict]:
        self.cmds.put(("gen", batch))
        return self.wait("gen", timeout)

    def stop(self) -> None:
        self.cmds.put(("stop",))
        self.proc.join(20)  # the engine shuts its core down first
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def prompts(
    count: int, seed: int, low: int, high: int, one_past_block: bool = False
) -> list[list[int]]:
    """Random prompts, log-uniform lengths; optionally one token past a block.

    A prompt of k full blocks plus one token is what a single engine with the
    prompt in its prefix cache computes exactly as a P/D consumer does: the
    k blocks from cache (loaded, on the consumer) and one token of query.
    """
    rng = random.Random(seed)
    lengths = [int(low * (high / low) ** rng.random()) for _ in range(count)]
    if one_past_block:
        lengths = [max(n - n % BLOCK_SIZE, BLOCK_SIZE) + 1 for n in lengths]
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def producer_params() -> dict:
    return pd_connectors.producer_params()


def pd_round(
    producer: Engine, consumer: Engine, batch: list[list[int]], max_tokens: int
) -> tuple[list, dict]:
    """Prefill on the producer, decode on the consumer after the transfer."""
    sent = [(p, producer_params(), 1) for p in batch]
    produced, _ = producer.generate(sent)
    requests = []
    for (prompt, params, _), out in zip(sent, produced):
        kvp = pd_connectors.consumer_params(
            producer.name, producer.port, params, out["kvp"]
        )
        requests.append((prompt, kvp, max_tokens))
    return consumer.generate(requests)


def scan_log(path: str) -> dict[str, list]:
    """Injected faults, mismatches and unverified reasons logged by an engine."""
    with open(path, errors="replace") as f:
        text = f.read()
    return {
        "injected": INJECTION.findall(text),
        "no_effect": NO_EFFECT.findall(text),
        "mismatched": MISMATCH.findall(text),
        "unverified": UNVERIFIED.findall(text),
        "sync_errors": ["x"] * text.count("GPU<->CPU sync detected"),
    }


def judge_faults(scan: dict[str, list]) -> tuple[dict[str, Any], bool]:
    """The faulty consumer's `scan_log`: injected, detected, undetected and
    false alarms by request, and whether every fault was reported and nothing
    else, injections without effect aside (`split_no_effect`)."""
    mismatched = set(scan["mismatched"])
    injected, no_effect = split_no_effect(
        {req for _, req in scan["injected"]}, set(scan["no_effect"]), mismatched
    )
    counts = {
        "injected": len(injected),
        "without_effect": sorted(no_effect),
        "detected": len(injected & mismatched),
        "undetected": sorted(injected - mismatched),
        "false_alarms": sorted(mismatched - injected),
        "kinds": sorted({k for k, _ in scan["injected"]}),
    }
    return counts, bool(injected) and injected == mismatched


def one_at_a_time(engine: Engine, requests: list) -> list[list[int]]:
    """Greedy outputs of requests sent one per launch (no batching)."""
    return [engine.generate([r])[0][0]["tokens"] for r in requests]


def top_logprobs(logprobs: Any) -> list[dict[int, float]]:
    """A completion's logprobs (vLLM's list of dicts or FlatLogprobs, a
    position possibly None) as plain {token id: logprob} dicts per token."""
    return [
        {int(t): float(lp.logprob) for t, lp in (step or {}).items()}
        for step in logprobs or []
    ]


def parting(a: list[int], a_top: list[dict], b: list[int], b_top: list[dict]) -> Any:
    """Where two greedy outputs of one prompt part and how close the choice
    was: None if equal, else (position, gap), the gap being the largest of
    the two runs' logprob differences between the two tokens chosen there
    (infinite when either token is outside the other run's top `TOP`)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        gaps = [
            abs(top[x] - top[y]) if x in top and y in top else float("inf")
            for top in (
                a_top[i] if i < len(a_top) else {},
                b_top[i] if i < len(b_top) else {},
            )
        ]
        return i, max(gaps)
    return None if len(a) == len(b) else (min(len(a), len(b)), float("inf"))


def compare_outputs(
    ref: list, ref_top: list, got: list, got_top: list, indices: list[int]
) -> dict[str, Any]:
    """Requests `indices` of two runs: which are equal, which part at a
    near-tie (`NEAR_TIE`), which part otherwise (a wrong output)."""
    ties, wrong = {}, {}
    for i in indices:
        part = parting(ref[i], ref_top[i], got[i], got_top[i])
        if part is None:
            continue
        (ties if part[1] <= NEAR_TIE else wrong)[i] = part
    return {
        "equal": len(indices) - len(ties) - len(wrong),
        "near_tie": ties,
        "wrong": wrong,
    }


def differing(a: list, b: list) -> list[int]:
    """Indices where two runs' outputs differ; -1 if their counts differ."""
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y] + (
        [-1] if len(a) != len(b) else []
    )


def equality_phase(ref: Engine, prod: Engine, count: int) -> dict[str, Any]:
    """Checksums off (ref) vs on (producer): same requests, same greedy ids."""
    eq_prompts = prompts(count, 1, 8, 4096)
    reqs = [(p, producer_params(), 16) for p in eq_prompts]
    off = one_at_a_time(ref, reqs)
    on = one_at_a_time(prod, reqs)
    diff = differing(off, on)
    batched: dict[str, list] = {"off": [], "off again": [], "on": []}
    for batch in batches(reqs, 25):
        for key, engine in (("off", ref), ("on", prod), ("off again", ref)):
            batched[key] += [o["tokens"] for o in engine.generate(batch)[0]]
    return {
        "prompts": len(eq_prompts),
        "identical": len(eq_prompts) - len(diff),
        "differing (index, prompt length)": [(i, len(eq_prompts[i])) for i in diff],
        "batched by 25: on vs off differing": differing(batched["off"], batched["on"]),
        "batched by 25: off vs off again differing": differing(
            batched["off"], batched["off again"]
        ),
    }


def single_engine(ref: Engine, batch: list[list[int]], max_tokens: int) -> tuple:
    """``ref``'s greedy outputs for a batch, fresh and then from its prefix cache.

    The first launch prefills each prompt whole; the second finds the prompt's
    full blocks in the prefix cache and computes only the tail, as a P/D
    consumer computes only the last prompt token after loading the rest. The
    two can differ in the last bits of the attention sums (query length decides
    the kernel's work split), so each P/D output is compared with the one
    computed the same way: loaded requests with ``cached``, recomputed
    requests with ``fresh``.
    """
    reqs = [(p, None, max_tokens) for p in batch]
    fresh = [o["tokens"] for o in ref.generate(reqs)[0]]
    cached = [o["tokens"] for o in ref.generate(reqs)[0]]
    return fresh, cached


def compare_pd(
    fresh: list, cached: list, got: list, loaded: list[bool], lengths: list[int]
) -> dict[str, Any]:
    expected = [c if hit else f for f, c, hit in zip(fresh, cached, loaded)]
    diff = differing(expected, got)
    return {
        "requests": len(got),
        "kv_loaded": sum(loaded),
        "recomputed": len(got) - sum(loaded),
        "equal_to_single_engine": len(got) - len(diff),
        "differing (index, prompt length)": [(i, lengths[i]) for i in diff],
        "equal_to_fresh_prefill": len(got) - len(differing(fresh, got)),
        "equal_to_cached_prefix": len(got) - len(differing(cached, got)),
        "recomputed_equal_to_fresh_prefill": sum(
            f == g for f, g, hit in zip(fresh, got, loaded) if not hit
        ),
    }


def pd_phase(
    ref: Engine,
    prod: Engine,
    consumer: Engine,
    consumer_off: Engine | None,
    count: int,
    seed: int,
    max_tokens: int,
    one_past_block: bool = False,
    batch: int = 25,
) -> dict[str, Any]:
    """P/D through ``consumer`` (one request per launch, then `batch` at a
    time, the result under "batched by <batch>").

    With ``consumer_off`` the same loads also go through a consumer with
    checksums off, so any output difference can be told apart from the
    checksums' effect: outputs that part are split into near-ties and wrong
    ones (`compare_outputs`).
    """
    pd_prompts = prompts(count, seed, 16, 2048, one_past_block)
    lengths = [len(p) for p in pd_prompts]
    fresh, cached, got, loaded = [], [], [], []
    on_out, off_out = [], []
    metrics: dict = {}
    for prompt in pd_prompts:
        f, c = single_engine(ref, [prompt], max_tokens)
        fresh += f
        cached += c
        out, metrics = pd_round(prod, consumer, [prompt], max_tokens)
        on_out += out
        got.append(out[0]["tokens"])
        loaded.append((out[0]["cached"] or 0) > 0)
        if consumer_off is not None:
            off_out += pd_round(prod, consumer_off, [prompt], max_tokens)[0]
    result = compare_pd(fresh, cached, got, loaded, lengths)
    if consumer_off is not None:
        off = [o["tokens"] for o in off_out]
        result.update(on_vs_off(on_out, off_out))
        result["P/D off equal_to_fresh_prefill"] = count - len(differing(fresh, off))
        result["P/D off equal_to_cached_prefix"] = count - len(differing(cached, off))
        # Concurrency: new prompts, `batch` loads at a time, on and off.
        b_prompts = prompts(count, seed + 100, 16, 2048, one_past_block)
        b_fresh, b_cached, b_on, b_off = [], [], [], []
        for group in batches(b_prompts, batch):
            f, c = single_engine(ref, group, max_tokens)
            b_fresh += f
            b_cached += c
            out, metrics = pd_round(prod, consumer, group, max_tokens)
            b_on += out
            b_off += pd_round(prod, consumer_off, group, max_tokens)[0]
        batched = compare_pd(
            b_fresh,
            b_cached,
            [o["tokens"] for o in b_on],
            [(o["cached"] or 0) > 0 for o in b_on],
            [len(p) for p in b_prompts],
        )
        batched.update(on_vs_off(b_on, b_off))
        result[f"batched by {batch}"] = batched
    result["metrics"] = metrics
    return result


def batched_result(result: dict[str, Any]) -> dict[str, Any]:
    """The pd phase's batched rounds ("batched by N"), {} without them."""
    return next((v for k, v in result.items() if k.startswith("batched by ")), {})


def on_vs_off(on: list[dict], off: list[dict]) -> dict[str, Any]:
    """The checksums-on consumer's replies against the off consumer's: which
    differ at all, and which of those part with a clear margin ("wrong")."""
    parted = compare_outputs(
        [o["tokens"] for o in off],
        [o.get("top", []) for o in off],
        [o["tokens"] for o in on],
        [o.get("top", []) for o in on],
        list(range(len(on))),
    )
    return {
        "P/D on vs P/D off differing": differing(
            [o["tokens"] for o in on], [o["tokens"] for o in off]
        ),
        "P/D on vs P/D off near-tie": parted["near_tie"],
        "P/D on vs P/D off wrong": sorted(parted["wrong"]),
    }


def log_size(engine: Engine) -> int:
    return os.path.getsize(engine.log) if os.path.exists(engine.log) else 0


def log_since(engine: Engine, offset: int) -> str:
    with open(engine.log, errors="replace") as f:
        f.seek(offset)
        return f.read()


def bad_load_then_local(
    prod: Engine, consumer: Engine, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """Request 1: a P/D load into ``consumer`` (its injector corrupts it);
    request 2: the same prompt as a normal local request on ``consumer``."""
    offset = log_size(consumer)
    first, _ = pd_round(prod, consumer, [prompt], max_tokens)
    second, metrics = consumer.generate([(prompt, None, max_tokens)])
    text = log_since(consumer, offset)
    injected = INJECTED_AT.findall(text)
    return {
        "injected": [(k, int(g), int(p)) for k, g, p in injected],
        "mismatch_logged": bool(MISMATCH.search(text)),
        "quarantined_logged": [int(n) for n in QUARANTINED.findall(text)],
        "first_tokens": first[0]["tokens"],
        "first_cached": first[0]["cached"],
        "second_tokens": second[0]["tokens"],
        "second_cached": second[0]["cached"] or 0,
        "metrics": metrics,
    }


def containment_phase(
    ref: Engine,
    prod: Engine,
    contained: Engine,
    uncontained: Engine,
    count: int,
    seed: int,
    max_tokens: int,
) -> dict[str, Any]:
    """R138 on real engines: a bad fail-open load must not spread.

    Per trial, a fresh prompt of 20 full blocks plus one token (NIXL pull loads
    all 21 blocks; the injector zeroes loaded block P, logged with P) goes
    through ``contained`` and then ``uncontained``: request 1 is the P/D load
    (it runs on the corrupted KV, fail-open), request 2 the same prompt as a
    normal local request on the same consumer.

    - contained: request 2 must hit exactly blocks 0..P-1 of request 1 (its
      ``num_cached_tokens`` is P * 16; P = 20, the partial last block, is
      never cached anyway) and its output must equal ``ref``'s for the same
      split: ``ref`` first prefills ``prompt[:P * 16 + 1]`` (caching blocks
      0..P-1), then runs the prompt (hit P blocks). A difference only from
      ``ref``'s full-hit output is also accepted as right (same KV, another
      query split; see `single_engine`).
    - uncontained: request 2 hits all 20 full blocks, the zeroed one included
      (``num_cached_tokens`` 320). A trial is conclusive when the zeroed block
      is a full one (P < 20); the spread shows when request 2's output differs
      from ``ref``'s full-hit output and from its split output.
    """
    rng = random.Random(seed)
    trials = []
    full_blocks = 20
    for _ in range(count):
        prompt = [rng.randrange(3, 2048) for _ in range(full_blocks * BLOCK_SIZE + 1)]
        on = bad_load_then_local(prod, contained, prompt, max_tokens)
        off = bad_load_then_local(prod, uncontained, prompt, max_tokens)
        position = on["injected"][0][2] if on["injected"] else None
        hit_blocks = min(position, full_blocks) if position is not None else 0
        if hit_blocks:
            ref.generate([(prompt[: hit_blocks * BLOCK_SIZE + 1], None, 1)])
        split, _ = ref.generate([(prompt, None, max_tokens)])
        full, _ = ref.generate([(prompt, None, max_tokens)])
        ref_split, ref_full = split[0]["tokens"], full[0]["tokens"]
        off_position = off["injected"][0][2] if off["injected"] else None
        trial = {
            "prompt_len": len(prompt),
            "contained": {
                "injected": on["injected"],
                "mismatch_logged": on["mismatch_logged"],
                "quarantined_logged": on["quarantined_logged"],
                "second_cached": on["second_cached"],
                "expected_cached": hit_blocks * BLOCK_SIZE,
                "ref_split_cached": split[0]["cached"] or 0,
                "second_equal_to_ref_split": on["second_tokens"] == ref_split,
                "second_equal_to_ref_full_hit": on["second_tokens"] == ref_full,
                "first_equal_to_ref_full_hit": on["first_tokens"] == ref_full,
            },
            "uncontained": {
                "injected": off["injected"],
                "mismatch_logged": off["mismatch_logged"],
                "quarantined_logged": off["quarantined_logged"],
                "second_cached": off["second_cached"],
                "conclusive": off_position is not None and off_position < full_blocks,
                "second_equal_to_ref_full_hit": off["second_tokens"] == ref_full,
                "second_equal_to_ref_split": off["second_tokens"] == ref_split,
                "first_equal_to_ref_full_hit": off["first_tokens"] == ref_full,
            },
            "tokens": {
                "ref_split": ref_split,
                "ref_full_hit": ref_full,
                "contained_first": on["first_tokens"],
                "contained_second": on["second_tokens"],
                "uncontained_first": off["first_tokens"],
                "uncontained_second": off["second_tokens"],
            },
        }
        trials.append(trial)
        c, u = trial["contained"], trial["uncontained"]
        print(
            f"[gpu] containment: P={position} contained cached "
            f"{c['second_cached']}/{c['expected_cached']} right="
            f"{c['second_equal_to_ref_split'] or c['second_equal_to_ref_full_hit']}"
            f"; uncontained P={off_position} cached {u['second_cached']} "
            f"wrong={not u['second_equal_to_ref_full_hit']}",
            flush=True,
        )
    contained_ok = [
        t["contained"]["injected"]
        and t["contained"]["mismatch_logged"]
        and t["contained"]["second_cached"] == t["contained"]["expected_cached"]
        and (
            t["contained"]["second_equal_to_ref_split"]
            or t["contained"]["second_equal_to_ref_full_hit"]
        )
        for t in trials
    ]
    conclusive = [t for t in trials if t["uncontained"]["conclusive"]]
    spread = [
        t
        for t in conclusive
        if not t["uncontained"]["second_equal_to_ref_full_hit"]
        and not t["uncontained"]["second_equal_to_ref_split"]
    ]
    return {
        "trials": len(trials),
        "contained_right": sum(map(bool, contained_ok)),
        "contained_hit_only_before_bad_block": sum(
            t["contained"]["second_cached"] == t["contained"]["expected_cached"]
            for t in trials
        ),
        "contained_quarantine_logged": sum(
            bool(t["contained"]["quarantined_logged"]) for t in trials
        ),
        "uncontained_conclusive": len(conclusive),
        "uncontained_hit_bad_block": sum(
            t["uncontained"]["second_cached"] == full_blocks * BLOCK_SIZE
            for t in conclusive
        ),
        "uncontained_second_wrong (spread)": len(spread),
        "uncontained_quarantine_logged": sum(
            bool(t["uncontained"]["quarantined_logged"]) for t in trials
        ),
        "ok": all(contained_ok) and bool(spread),
        "trials_detail": trials,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--num-equality", type=int, default=100)
    parser.add_argument("--num-pd", type=int, default=200)
    parser.add_argument(
        "--pd-batch",
        type=int,
        default=25,
        help="pd phase: requests sent at once in its batched rounds (issue 30: "
        "64 or 256 for the hook timer's host profile at that concurrency)",
    )
    parser.add_argument("--num-faults", type=int, default=100)
    parser.add_argument("--fault-rate", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--num-containment",
        type=int,
        default=8,
        help="containment phase: trials (a bad load, then a local request)",
    )
    parser.add_argument("--overhead-rounds", type=int, default=15)
    parser.add_argument(
        "--sync-scheduling",
        action="store_true",
        help="no async scheduling: batch composition independent of timing",
    )
    parser.add_argument(
        "--one-past-block",
        action="store_true",
        help="P/D prompts of whole blocks plus one token (see `prompts`)",
    )
    parser.add_argument(
        "--phases",
        default="equality,pd,faults",
        help="comma-separated phases (also: containment)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="engine core inside each engine process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0): a batch is all in the scheduler "
        "before its first step, so batching does not depend on timing",
    )
    parser.add_argument(
        "--parallel-start",
        action="store_true",
        help="start every engine at once, each with a fixed 1 GiB KV cache "
        "(kv_cache_memory_bytes: no memory profiling to race)",
    )
    parser.add_argument(
        "--debug-faulty",
        action="store_true",
        help="log the faulty consumer at DEBUG (which blocks each fault and "
        "mismatch touched)",
    )
    parser.add_argument("--producer-tp", type=int, default=1)
    parser.add_argument(
        "--connector",
        choices=pd_connectors.CHOICES,
        default="nixl-pull",
        help="P/D connector of all engines but ref (kv_checksum_pd_connectors)",
    )
    parser.add_argument(
        "--consumer-block-size",
        type=int,
        default=BLOCK_SIZE,
        help="the consumers' block size (producer and ref keep 16): 32 checks "
        "loads in 16-token chunks (R135); vLLM 0.33.0's NIXL needs consumer "
        "blocks that are multiples of the producer's",
    )
    parser.add_argument("--consumer-tp", type=int, default=1)
    parser.add_argument(
        "--overhead-only",
        action="store_true",
        help="start only ref and producer, without the sync check, and time them",
    )
    parser.add_argument(
        "--overhead-control",
        action="store_true",
        help="with --overhead-only: also time a second engine with checksums off",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    build_model(args.model)
    ctx = mp.get_context("spawn")
    base: dict[str, Any] = {"_model": args.model}
    if args.overhead_only:
        # Producer blocks nobody pulls are freed after this lease, so that
        # repeated launches do not fill the KV cache.
        base["kv_lease_duration"] = 6
    on = {**base, "enable_kv_checksum": True}
    closed = {**on, "kv_checksum_fail_closed": True}
    faulty = {
        **closed,
        "kv_checksum_fault_injection": {"rate": args.fault_rate, "seed": 7},
    }
    if args.debug_faulty:  # injection details and mismatched blocks' ids
        faulty["_env"] = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    specs = [
        ("ref", base, 5600),
        ("producer", on, 5700),
        ("consumer", closed, 5800),
        ("faulty", faulty, 5900),
        ("consumer_off", base, 6000),
    ]
    # Heterogeneous TP (issue: two GPUs): the producer and the consumers may use
    # other TP sizes than the TP 1 reference.
    specs[1] = (specs[1][0], {**specs[1][1], "_tp": args.producer_tp}, specs[1][2])
    for i in (2, 3, 4):
        consumer = {
            **specs[i][1],
            "_tp": args.consumer_tp,
            "_block_size": args.consumer_block_size,
        }
        specs[i] = (specs[i][0], consumer, specs[i][2])
    # Containment (R138): fail-open consumers, every load corrupted; the
    # second with containment off (checksums and the injector still on).
    bad_loads = {
        **on,
        "_tp": args.consumer_tp,
        "kv_checksum_fault_injection": {
            "rate": 1.0,
            "kinds": ["zero_block"],
            "seed": 11,
        },
    }
    specs.append(("contained", bad_loads, 6200))
    specs.append(
        (
            "uncontained",
            {**bad_loads, "_env": {NO_CONTAINMENT_ENV: "1"}},
            6300,
        )
    )
    specs = [(name, extra, port + PORT_OFFSET) for name, extra, port in specs]
    phases = args.phases.split(",")
    needed = {"ref", "producer"}
    if "pd" in phases:
        needed |= {"consumer", "consumer_off"}
    if "faults" in phases:
        needed.add("faulty")
    if "containment" in phases:
        needed |= {"contained", "uncontained"}
    specs = [spec for spec in specs if spec[0] in needed]
    connector_info = pd_connectors.configure(specs, args.connector)
    if args.sync_scheduling:
        os.environ["KV_CHECKSUM_ASYNC"] = "0"
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.overhead_only:
        os.environ["KV_CHECKSUM_SYNC_CHECK"] = "0"
        specs = specs[:2]
        if args.overhead_control:
            specs.append(("off_again", base, 6100 + PORT_OFFSET))
    engines: dict[str, Engine] = {}
    summary: dict[str, Any] = {
        "model": args.model,
        # vLLM's batch-invariant mode has no Mamba kernels.
        "batch_invariant": not args.overhead_only and args.model not in HYBRID_MODELS,
        "async_scheduling": not args.sync_scheduling,
        "in_process": args.in_process,
        **connector_info,
    }
    ok = True
    try:
        if args.parallel_start:
            for name, extra, port in specs:
                env = {
                    **extra.get("_env", {}),
                    "VLLM_BATCH_INVARIANT": "1" if summary["batch_invariant"] else "0",
                }
                extra = {**extra, "_env": env, "_kv_bytes": PARALLEL_KV_BYTES}
                engines[name] = Engine(ctx, name, extra, port, args.out)
        for name, extra, port in specs:  # one at a time: memory profiling
            env = {
                **extra.get("_env", {}),
                "VLLM_BATCH_INVARIANT": "1" if summary["batch_invariant"] else "0",
            }
            if name not in engines:
                engines[name] = Engine(
                    ctx, name, {**extra, "_env": env}, port, args.out
                )
            try:
                engines[name].wait("ready", 600)
            except RuntimeError:
                if name != "ref" or not summary["batch_invariant"]:
                    raise
                print("[gpu] ref failed in batch-invariant mode; retrying without")
                summary["batch_invariant"] = False
                env = {"VLLM_BATCH_INVARIANT": "0"}
                engines[name] = Engine(
                    ctx, name, {**extra, "_env": env}, port + 50, args.out
                )
                engines[name].wait("ready", 600)
            print(f"[gpu] {name} ready at {time.time() - t0:.0f}s", flush=True)
        ref, prod = engines["ref"], engines["producer"]
        if args.overhead_only:
            sides = {"off": ref, "on": prod}
            if "off_again" in engines:
                sides["off again"] = engines["off_again"]
            summary["overhead"] = measure_overhead(
                sides, args.overhead_rounds, MAX_MODEL_LENS[args.model]
            )
            raise SystemExit(0)

        summary["one_past_block"] = args.one_past_block
        if "equality" in phases:
            summary["equality"] = equality_phase(ref, prod, args.num_equality)
            same = summary["equality"]["identical"]
            ok &= same == args.num_equality
            print(f"[gpu] equality: {same}/{args.num_equality} identical")
        for phase, consumer_name, count, seed in (
            ("pd", "consumer", args.num_pd, 2),
            ("faults", "faulty", args.num_faults, 3),
        ):
            if phase not in phases:
                continue
            summary[phase] = result = pd_phase(
                ref,
                prod,
                engines[consumer_name],
                engines["consumer_off"] if phase == "pd" else None,
                count,
                seed,
                args.max_tokens,
                args.one_past_block,
                args.pd_batch,
            )
            equal = result["equal_to_single_engine"]
            print(f"[gpu] {phase}: {equal}/{count} equal, {time.time() - t0:.0f}s")
            with open(os.path.join(args.out, f"{phase}.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)
            if batched_result(result):
                equal = batched_result(result)["equal_to_single_engine"]
                print(f"[gpu] {phase} batched: {equal}/{count} equal", flush=True)
            ok &= pd_outputs_ok(result, count, args.model in HYBRID_MODELS)
        if "containment" in phases:
            summary["containment"] = result = containment_phase(
                ref,
                prod,
                engines["contained"],
                engines["uncontained"],
                args.num_containment,
                4,
                max(args.max_tokens, 16),
            )
            with open(os.path.join(args.out, "containment.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)
            result = {k: v for k, v in result.items() if k != "trials_detail"}
            summary["containment"] = result
            print(f"[gpu] containment: {result}", flush=True)
            ok &= result["ok"]
    except SystemExit:
        pass
    except BaseException:
        print("[gpu] FAILED\n" + traceback.format_exc(), flush=True)
        ok = False
    finally:
        for engine in engines.values():
            engine.stop()
    logs = {n: scan_log(e.log) for n, e in engines.items() if os.path.exists(e.log)}
    summary["logs"] = {n: {k: len(v) for k, v in s.items()} for n, s in logs.items()}
    if "consumer" in logs:
        clean = logs["consumer"]
        ok &= not clean["mismatched"] and not clean["unverified"]
    if "faulty" in logs:
        counts, every_fault_reported = judge_faults(logs["faulty"])
        summary.setdefault("faults", {}).update(counts)
        ok &= every_fault_reported
        if args.model in HYBRID_MODELS and "recomputed" in summary["faults"]:
            # Every caught state fault is recomputed (fail-closed "recompute").
            ok &= summary["faults"]["recomputed"] == counts["injected"]
    for name in ("producer", "consumer", "faulty"):
        if name in logs:
            ok &= not logs[name]["sync_errors"]
    summary["ok"] = bool(ok)
    summary["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return 0 if ok else 1


def pd_outputs_ok(result: dict[str, Any], count: int, hybrid: bool) -> bool:
    """The output check of a P/D phase (the issues' "outputs equal to a
    checksums-off consumer"): with an off consumer, the checksums-on
    consumer's outputs equal its outputs or part only at a near-tie (both
    choices within `NEAR_TIE` in both runs), one at a time and batched, and
    every request loaded KV; without one (faults phase), every recomputed request of
    an attention model equals a whole-prompt prefill (hybrid models run
    without batch invariance: their faults are judged by the log scan).
    Equality with the single engine is reported only: a consumer computes the
    last prompt token over loaded KV, the single engine inside its prefill, and
    the off consumer parts from it on the same prompts (H200, 2026-11-30)."""
    if "P/D on vs P/D off differing" not in result:
        if hybrid:
            return True
        return result["recomputed_equal_to_fresh_prefill"] == result["recomputed"]
    batched = batched_result(result)
    print(
        f"[gpu] on vs off differing {result['P/D on vs P/D off differing']}, "
        f"batched {batched.get('P/D on vs P/D off differing')}, loaded "
        f"{result['kv_loaded']}/{count} + {batched.get('kv_loaded')}/{count}",
        flush=True,
    )
    key = "P/D on vs P/D off wrong"
    if key not in result:  # runs recorded before the near-tie rule
        key = "P/D on vs P/D off differing"
    return (
        not result[key]
        and not batched.get(key)
        and result["kv_loaded"] == count
        and batched.get("kv_loaded") == count
    )


def measure_overhead(
    sides: dict[str, Engine], rounds: int, max_model_len: int
) -> dict[str, Any]:
    """Producer prefill time per engine ("off", "on", maybe "off again").

    Each launch prefills a batch of producer requests (one output token, so the
    time is the batch's time to first token; prompt tokens over that time is
    the prefill throughput). The engines take turns in a rotating order so
    drift affects all alike. Reported per side: median and min-max over the
    rounds (the first dropped); per other side, the median of its per-round
    differences to "off" with their min-max. "off again", a second engine with
    checksums off, measures how much two engines differ without any change.
    """
    long_prompt = 8192 if max_model_len > 8192 else 4096
    cases = {
        "1K prompt, concurrency 1": (1, 1024),
        "1K prompts, concurrency 32": (32, 1024),
        f"{long_prompt // 1024}K prompt, concurrency 1": (1, long_prompt),
    }
    names = list(sides)
    report: dict[str, Any] = {}
    for label, (concurrency, length) in cases.items():
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            batch = prompts(concurrency, 1000 + r, length, length + 1)
            reqs = [(p, producer_params(), 1) for p in batch]
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                elapsed = sides[name].generate(reqs)[1]["elapsed_s"]
                times[name].append(elapsed * 1e3)
        stats: dict[str, Any] = {}
        for name, values in times.items():
            kept = sorted(values[1:])  # the first launch warms up
            median = kept[len(kept) // 2]
            stats[name] = {
                "median_ms": round(median, 3),
                "min_ms": round(kept[0], 3),
                "max_ms": round(kept[-1], 3),
                "prompt_tokens_per_s": round(concurrency * length / median * 1e3),
            }
        for name in names[1:]:
            paired = sorted(a - b for a, b in zip(times[name][1:], times["off"][1:]))
            stats[f"{name} - off, paired ms"] = {
                "median": round(paired[len(paired) // 2], 3),
                "min": round(paired[0], 3),
                "max": round(paired[-1], 3),
            }
        report[label] = stats
        print(f"[gpu] overhead {label}: {stats}", flush=True)
    return report


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
