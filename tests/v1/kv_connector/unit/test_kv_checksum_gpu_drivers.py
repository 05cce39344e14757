# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU drivers' host-side rules, checked on CPU before device time is spent.

- The P/D driver gives a producer request and the consumer request that loads
  its KV one request id, as a proxy does with X-Request-Id: NIXL push (R104)
  matches a consumer's registration to the producer's finished blocks by that
  id. An H200 run with the engines' own counters hung: the producer had
  served two consumers ("0", "1"), the checksums-off consumer's first request
  was "0" again.
- The offload driver accepts an output that parts from its reference only at
  a near-tie of the two greedy candidates (numerics of another computation
  order), never one that parts with a clear margin (wrong KV).
"""

import importlib
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.cpu

EXAMPLES = Path(__file__).parents[4] / "examples"


@pytest.fixture
def drivers(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    monkeypatch.syspath_prepend(str(EXAMPLES / "disaggregated"))
    monkeypatch.syspath_prepend(str(EXAMPLES / "offload"))
    for name in (
        "kv_checksum_pd_connectors",
        "kv_checksum_pd_gpu",
        "kv_checksum_offload_gpu",
    ):
        sys.modules.pop(name, None)
    connectors = importlib.import_module("kv_checksum_pd_connectors")
    pd_gpu = importlib.import_module("kv_checksum_pd_gpu")
    offload_gpu = importlib.import_module("kv_checksum_offload_gpu")
    monkeypatch.delenv(connectors.CONNECTOR_ENV, raising=False)
    return pd_gpu, offload_gpu


@pytest.mark.parametrize("connector", ["nixl-pull", "nixl-push", "mooncake"])
def test_producer_and_consumer_share_one_request_id_r104(
    drivers: tuple[ModuleType, ModuleType],
    connector: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R104 (push matches by request id): each consumer request gets the id of
    the producer request whose KV it loads; ids are numbers that grow within
    a batch (`LLM.generate` sorts its outputs by int(id)), unique per pair.

    Bugs this fails: leaving ids to each engine's counter (the hang above);
    non-numeric ids (vLLM's sort raised ValueError on the H200).
    """
    pd_gpu, _ = drivers
    connectors = pd_gpu.pd_connectors
    monkeypatch.setenv(connectors.CONNECTOR_ENV, connector)
    returned = {"do_remote_prefill": True, "remote_prefill_cached_tokens": 3}
    sent = [connectors.producer_params() for _ in range(3)]
    loads = [connectors.consumer_params("producer", 5700, p, returned) for p in sent]
    produced = list(pd_gpu.request_ids([([1], dict(p), 1) for p in sent]))
    consumed = list(pd_gpu.request_ids([([1], kvp, 4) for kvp in loads]))
    assert produced == consumed
    assert len(set(produced)) == 3
    assert [int(i) for i in produced] == sorted(int(i) for i in produced)
    # The id is taken out before vLLM sees the params.
    assert all(connectors.REQUEST_ID not in kvp for kvp in loads)
    # Requests without an id of the driver still get unique numeric ids.
    own = list(pd_gpu.request_ids([([1], None, 1), ([2], {}, 1)]))
    assert len(set(own) | set(produced)) == 5
    assert all(i.isdigit() for i in own)


def test_parting_tells_near_ties_from_wrong_outputs_r139(
    drivers: tuple[ModuleType, ModuleType],
) -> None:
    """R139's GPU proof (a failed load back is recomputed right): a
    difference counts as a near-tie only when, at the first differing token,
    both tokens are in both runs' top candidates within `NEAR_TIE`.

    Bugs this fails: comparing only the first run's logprobs (a wrong output
    whose own run was sure of its token would pass); looking at the last
    instead of the first differing position; counting a token outside the
    top candidates as a tie.
    """
    pd_gpu, _ = drivers
    tie = pd_gpu.NEAR_TIE
    ref, ref_top = [5, 7, 9], [{5: -0.1, 6: -3.0}, {7: -0.70, 8: -0.72}, {9: -0.2}]
    close = [5, 8, 1]
    close_top = [{5: -0.1, 6: -3.0}, {8: -0.69, 7: -0.71}, {1: -0.1}]
    assert pd_gpu.parting(ref, ref_top, ref, ref_top) is None
    position, gap = pd_gpu.parting(ref, ref_top, close, close_top)
    assert position == 1 and gap == pytest.approx(0.02)
    # Sure of its own token: its run's gap is large.
    sure_top = [{5: -0.1, 6: -3.0}, {8: -0.01, 7: -4.0}, {1: -0.1}]
    assert pd_gpu.parting(ref, ref_top, close, sure_top)[1] > tie
    # A token outside the other run's top candidates.
    far_top = [{5: -0.1, 6: -3.0}, {8: -0.69, 3: -0.71}, {1: -0.1}]
    assert math.isinf(pd_gpu.parting(ref, ref_top, close, far_top)[1])
    result = pd_gpu.compare_outputs(
        [ref, ref, ref],
        [ref_top] * 3,
        [ref, close, close],
        [ref_top, close_top, sure_top],
        [0, 1, 2],
    )
    assert result["equal"] == 1
    assert list(result["near_tie"]) == [1]
    assert list(result["wrong"]) == [2]


def test_hybrid_model_has_attention_and_mamba2_layers_r36(
    drivers: tuple[ModuleType, ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R36 on real engines needs a model vLLM 0.33.0's NIXL can transfer: its
    handshake (`_build_fa_remote`) needs an attention group, which a pure
    Mamba2 model lacks (StopIteration on the H200). The driver's ``hybrid``
    model is a Nemotron-H that vLLM resolves as hybrid, with Mamba2 and
    attention layers and the requested Mamba2 group count.

    Bugs this fails: a pattern without "*" (a pure Mamba2 model again); a
    transformers version that ignores ``hybrid_override_pattern`` and builds
    its default 52-layer pattern.
    """
    from vllm.config import ModelConfig

    pd_gpu, _ = drivers
    for shape, groups in (("hybrid", 1), ("hybrid-g2", 2)):
        folder = str(tmp_path / shape)
        monkeypatch.setitem(pd_gpu.MODELS, shape, folder)
        assert pd_gpu.build_model(shape) == folder
        config = ModelConfig(
            model=folder, dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True
        )
        assert config.architectures == ["NemotronHForCausalLM"]
        assert config.is_hybrid
        pattern = config.hf_config.hybrid_override_pattern
        assert pattern == pd_gpu.HYBRID_PATTERN
        assert "*" in pattern and "M" in pattern
        assert config.hf_config.n_groups == groups


def test_pd_output_check_compares_with_the_checksums_off_consumer_r4(
    drivers: tuple[ModuleType, ModuleType],
) -> None:
    """R4 on real engines (a failed check recomputes through vLLM's own
    policy, a clean load changes nothing): a P/D phase passes when the
    checksums-on consumer equals the off consumer and every request loaded,
    whatever the single engine says (the off consumer parted from it on the
    same 3/60 prompts on the H200); the faults phase needs every recompute
    equal to a whole-prompt prefill.

    Bugs this fails: dropping the on vs off comparison (one at a time or
    batched); counting a recomputed request of the clean consumer as a load;
    not checking recomputes in the faults phase.
    """
    pd_gpu, _ = drivers
    clean = {
        "P/D on vs P/D off differing": [],
        "kv_loaded": 4,
        "equal_to_single_engine": 1,
        "batched by 25": {"P/D on vs P/D off differing": [], "kv_loaded": 4},
    }
    assert pd_gpu.pd_outputs_ok(clean, 4, hybrid=False)
    assert not pd_gpu.pd_outputs_ok(
        {**clean, "P/D on vs P/D off differing": [2]}, 4, hybrid=False
    )
    batched_diff = {"P/D on vs P/D off differing": [0], "kv_loaded": 4}
    assert not pd_gpu.pd_outputs_ok(
        {**clean, "batched by 25": batched_diff}, 4, hybrid=True
    )
    assert not pd_gpu.pd_outputs_ok({**clean, "kv_loaded": 3}, 4, hybrid=True)
    # Parting only at a near-tie passes; parting with a margin does not.
    tied = {
        **clean,
        "P/D on vs P/D off differing": [1],
        "P/D on vs P/D off wrong": [],
        "batched by 25": {**clean["batched by 25"], "P/D on vs P/D off wrong": []},
    }
    assert pd_gpu.pd_outputs_ok(tied, 4, hybrid=True)
    assert not pd_gpu.pd_outputs_ok(
        {**tied, "P/D on vs P/D off wrong": [1]}, 4, hybrid=True
    )
    batched_wrong = {**tied["batched by 25"], "P/D on vs P/D off wrong": [0]}
    assert not pd_gpu.pd_outputs_ok(
        {**tied, "batched by 25": batched_wrong}, 4, hybrid=True
    )
    faults = {"recomputed": 3, "recomputed_equal_to_fresh_prefill": 3}
    assert pd_gpu.pd_outputs_ok(faults, 4, hybrid=False)
    wrong = {**faults, "recomputed_equal_to_fresh_prefill": 2}
    assert not pd_gpu.pd_outputs_ok(wrong, 4, hybrid=False)


def test_pd_output_check_reads_batched_rounds_of_any_size_r4(
    drivers: tuple[ModuleType, ModuleType],
) -> None:
    """`--pd-batch 64` (issue 30: the host profile at 64 running) files the
    batched rounds under "batched by 64"; the R4 check reads them as it reads
    "batched by 25". Bug: a reader still keyed on "batched by 25", which finds
    no batched rounds at another size (a clean run then fails on its missing
    load count, a wrong batched output is never looked at)."""
    pd_gpu, _ = drivers
    batched = {"P/D on vs P/D off differing": [], "kv_loaded": 4}
    clean = {
        "P/D on vs P/D off differing": [],
        "kv_loaded": 4,
        "batched by 64": batched,
    }
    assert pd_gpu.pd_outputs_ok(clean, 4, hybrid=False)
    wrong = {**batched, "P/D on vs P/D off differing": [3]}
    assert not pd_gpu.pd_outputs_ok({**clean, "batched by 64": wrong}, 4, hybrid=False)
    assert pd_gpu.batched_result({"kv_loaded": 4}) == {}


@pytest.mark.parametrize("flat", [False, True], ids=["list", "flat"])
def test_top_logprobs_reads_vllm_logprobs_r139(
    drivers: tuple[ModuleType, ModuleType], flat: bool
) -> None:
    """R139's output check reads vLLM's own sample logprobs containers (a list
    of dicts, or FlatLogprobs) into the dicts `parting` compares, a missing
    position as an empty dict.

    Bugs this fails: calling ``.items()`` on a None position; keeping
    vLLM's Logprob objects (not comparable as numbers); losing a position.
    """
    from vllm.logprobs import Logprob, create_sample_logprobs

    pd_gpu, _ = drivers
    logprobs = create_sample_logprobs(flat)
    logprobs.append({5: Logprob(-0.25, 1), 6: Logprob(-2.0, 2)})
    logprobs.append(None)
    logprobs.append({7: Logprob(-0.5, 1)})
    assert pd_gpu.top_logprobs(logprobs) == [{5: -0.25, 6: -2.0}, {}, {7: -0.5}]
    assert pd_gpu.top_logprobs(None) == []


def test_engine_command_loop_replies_and_stops(
    drivers: tuple[ModuleType, ModuleType],
) -> None:
    """Driver plumbing, no SPEC requirement of its own (every GPU proof runs
    through it). Both drivers' engine processes run one loop
    (`serve_commands`): "ready" after the build, one reply per command, an
    "error" reply (not a dead process) when a command raises, the core shut
    down at "stop"; a failed build replies "error" and serves nothing.

    Bugs this fails: replying "ready" before the build finished; a command's
    exception ending the loop (the driver would wait for its timeout);
    leaving the engine core running at "stop".
    """
    import queue

    pd_gpu, _ = drivers
    shut: list[int] = []

    class Core:
        def shutdown(self, timeout: float) -> None:
            shut.append(1)

    class FakeLLM:
        llm_engine = type("Engine", (), {"engine_core": Core()})()

    def answer(llm: object, cmd: tuple) -> object:
        if cmd[1] == "boom":
            raise ValueError("boom")
        return cmd[1] * 2

    cmds: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    for cmd in (("gen", 2), ("gen", "boom"), ("gen", 5), ("stop",)):
        cmds.put(cmd)
    pd_gpu.serve_commands("e", FakeLLM, answer, cmds, results)
    got = [results.get_nowait() for _ in range(4)]
    assert [(n, kind) for n, kind, _ in got] == [("e", "ready")] + [
        ("e", k) for k in ("gen", "error", "gen")
    ]
    assert got[1][2] == 4 and got[3][2] == 10 and "boom" in got[2][2]
    assert shut == [1] and results.empty()

    def fail() -> object:
        raise RuntimeError("no GPU")

    pd_gpu.serve_commands("f", fail, answer, queue.Queue(), results)
    name, kind, text = results.get_nowait()
    assert (name, kind) == ("f", "error") and "no GPU" in text


def test_spread_phase_prompts_and_cases_r138(
    drivers: tuple[ModuleType, ModuleType],
) -> None:
    """Issue 32's GPU proof, host side: B repeats A's prompt, each eviction's
    fillers hold more blocks than the GPU cache, and a scenario counts only
    when A's fault was injected and caught and B's own load was clean; B is
    served on bad-derived KV when it found more than the prefix cached.

    Bugs this fails: B given another prompt than A (B could never find A's
    suffix: the phase proves nothing); fillers fitting in the GPU cache (B
    hits the GPU, not the host tier); a scenario whose B load was itself
    faulted counted as exercised; B's cached tokens compared with the whole
    prompt instead of the prefix (a B that loaded A's suffix passes)."""
    _, offload_gpu = drivers
    args = type(
        "Args",
        (),
        {
            "prefix_blocks": 4,
            "spread_scenarios": 3,
            "spread_suffix_blocks": 2,
            "gpu_blocks": 64,
        },
    )()
    prompts = offload_gpu.spread_prompts(args)
    bs = offload_gpu.BLOCK_SIZE
    assert prompts["b"] == prompts["a"]
    assert len(prompts["a"]) == 3
    for p, a, c in zip(prompts["p"], prompts["a"], prompts["c"]):
        assert p[: 4 * bs] == a[: 4 * bs] == c[: 4 * bs]
        assert len(a) == 6 * bs + 1 and p[4 * bs :] != a[4 * bs : 5 * bs + 1]
    assert sum(len(f) // bs for f in prompts["fill"]) > args.gpu_blocks
    assert offload_gpu.SPREAD_STAGES.count("fill") == 2

    prefix = 4 * bs
    cases = offload_gpu.spread_cases(
        ["1", "2", "3", "4"],
        ["11", "12", "13", "14"],
        injected={"1", "2", "3", "13"},
        mismatched={"1", "2", "3", "13"},
        b_cached=[prefix, prefix + 2 * bs, 0, prefix + 2 * bs],
        prefix_tokens=prefix,
    )
    # Scenario 2: B's own load faulted ("13"); scenario 3: A's load clean.
    assert cases == {"exercised": [0, 1], "served": [1]}


def test_issue29_models_resolve_to_the_intended_families(
    drivers: tuple[ModuleType, ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R32, R36 (issue 29): the driver's ``mla``, ``qwen3next`` and ``mamba1``
    models build on CPU and vLLM 0.33.0 resolves them as meant: ``mla`` a
    DeepSeek-V3 with an MLA latent cache of kv_lora_rank + qk_rope_head_dim
    per token and no MoE (no MoE kernels on the bundle); ``qwen3next`` hybrid
    GDN + attention (NIXL needs an attention group); ``mamba1`` a Jamba with
    Mamba1 and attention layers and one expert (dense MLPs).

    Bugs this fails: ``first_k_dense_replace`` below the layer count (MoE
    layers); a DeepSeek config vLLM serves without MLA (MHA: a per-head
    cache, not the replicated latent); an all-dense Qwen3-Next (vLLM refuses
    it); a Jamba pattern without attention layers; a forced MLA backend that
    is not TRITON_MLA.
    """
    from vllm.config import ModelConfig

    pd_gpu, _ = drivers
    configs = {}
    for shape in ("mla", "qwen3next", "mamba1"):
        folder = str(tmp_path / shape)
        monkeypatch.setitem(pd_gpu.MODELS, shape, folder)
        assert pd_gpu.build_model(shape) == folder
        configs[shape] = ModelConfig(
            model=folder, dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True
        )
    mla = configs["mla"]
    dims = pd_gpu.MLA_DIMS
    assert mla.architectures == ["DeepseekV3ForCausalLM"]
    assert mla.use_mla and not mla.is_hybrid and not mla.is_moe
    assert mla.get_head_size() == dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    # The GPU run of 2026-12-01 failed at engine start with (64, 32, 64): the
    # MLA prefill backend takes only the dimensions it lists (read from its
    # source: it does not import without CUDA).
    import vllm.v1.attention.backends.mla.prefill as mla_prefill

    source = (Path(mla_prefill.__file__).parent / "flash_attn.py").read_text()
    listed = re.findall(
        r"qk_nope_head_dim=(\d+),\s*qk_rope_head_dim=(\d+),\s*v_head_dim=(\d+)",
        source,
    )
    assert listed
    wanted = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    assert tuple(str(dims[k]) for k in wanted) in listed
    assert mla.hf_config.first_k_dense_replace >= mla.hf_config.num_hidden_layers
    backend = pd_gpu.ENGINE_KWARGS["mla"]["attention_config"]["backend"]
    assert backend == "TRITON_MLA"

    gdn = configs["qwen3next"]
    assert gdn.architectures == ["Qwen3NextForCausalLM"]
    assert gdn.is_hybrid and not gdn.use_mla
    assert set(gdn.hf_config.layer_types) == {"linear_attention", "full_attention"}
    assert not gdn.hf_config.mlp_only_layers
    assert pd_gpu.ENGINE_KWARGS["qwen3next"] == {"gdn_prefill_backend": "triton"}

    jamba = configs["mamba1"]
    assert jamba.architectures == ["JambaForCausalLM"]
    assert jamba.is_hybrid and not jamba.use_mla
    assert jamba.hf_config.layers_block_type == ["mamba", "attention"] * 2
    assert jamba.hf_config.layers_num_experts == [1] * 4
    assert {"qwen3next", "mamba1"} <= pd_gpu.HYBRID_MODELS
    assert "mla" not in pd_gpu.HYBRID_MODELS


def test_prefix_phase_log_scan_and_workload_r140(
    drivers: tuple[ModuleType, ModuleType],
) -> None:
    """Issue 31's GPU proof, host side: a prefix_hit injection counts as
    caught only when a prefix-hit mismatch of the same request follows it in
    the log; the workload shares prefixes, one request at a time first.

    Bugs this fails: a mismatch of another request (or one logged before the
    injection) taken as the catch; a load fault's line counted as a
    prefix-hit one; prompts that share no prefix (no hit to fault)."""
    _, offload_gpu = drivers
    log = "\n".join(
        [
            "KV checksum mismatch in prefix-cache hit of request 3-ab: group 0",
            "KV checksum fault injection: prefix_hit into request 3-ab group 0 "
            "block position 1.",
            "KV checksum fault injection: prefix_hit into request 5-cd group 0 "
            "block position 0.",
            "KV checksum fault injection: bit_flip into request 6-ef group 0 "
            "block position 0.",
            "KV checksum mismatch in prefix-cache hit of request 5-cd: group 0",
            "KV checksum fault injection: prefix_hit into request 7-gh group 0 "
            "block position 2.",
            "KV checksum mismatch in prefix-cache hit of request 8-ij: group 0",
        ]
    )
    found = offload_gpu.scan_prefix_faults(log)
    assert found == {"injected": ["3-ab", "5-cd", "7-gh"], "uncaught": ["3-ab", "7-gh"]}
    args = type(
        "Args",
        (),
        {"prefix_blocks": 3, "prefix_count": 2, "prefix_requests": 12, "batch": 4},
    )()
    batches = offload_gpu.prefix_workload(args)
    assert [len(b) for b in batches] == [1, 1, 1, 4, 4, 1]
    prompts = [p for b in batches for p in b]
    head = 3 * offload_gpu.BLOCK_SIZE
    assert len({tuple(p[:head]) for p in prompts}) == 2
    assert prompts[0][:head] == prompts[2][:head] != prompts[1][:head]


def test_pd_fault_judge_drops_injections_without_effect_r131(
    drivers: tuple[ModuleType, ModuleType], tmp_path: Path
) -> None:
    """R131: the P/D driver's fault verdict reads the injector's "had no
    effect" line: an unreported copy of equal bytes is no fault, a reported
    one stays a fault, and a real unreported fault still fails the run. Bugs
    caught: a no-op copy failing the run as undetected; the no-effect line
    read as another injection; a real miss passing."""
    pd_gpu, _ = drivers
    inject = (
        "WARNING KV checksum fault injection: stale_block into request {} "
        "group 0 block position 2.\n"
    )
    none = (
        "WARNING KV checksum fault injection had no effect: stale_block into "
        "request {} group 0 block position 2 copied block 7, which held the same "
        "bytes on this worker; no fault to report.\n"
    )
    mismatch = (
        "ERROR KV checksum mismatch for request {}: group 0 block positions [2]\n"
    )
    log = tmp_path / "faulty.log"
    log.write_text(
        inject.format("1")
        + inject.format("2")
        + inject.format("3")
        + none.format("2")
        + none.format("3")
        + mismatch.format("1")
        + mismatch.format("3")
    )
    counts, ok = pd_gpu.judge_faults(pd_gpu.scan_log(str(log)))
    assert ok, counts
    assert counts["injected"] == 2 and counts["without_effect"] == ["2"]
    assert counts["detected"] == 2 and counts["undetected"] == []
    log.write_text(inject.format("1") + inject.format("2") + mismatch.format("1"))
    counts, ok = pd_gpu.judge_faults(pd_gpu.scan_log(str(log)))
    assert not ok and counts["undetected"] == ["2"]
