"""The per-recipe report: Figure 7's four configurations and the draft-free methods, greedy SpD == AR
check, outputs, missing weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from benchmarks import intervals, report


def write_recipe(path, tlm: str, dlm: str | None) -> str:
    """A draft-model recipe, or with dlm None one whose speculation is prompt lookup."""
    table = f'[dlm]\nmodel = "{dlm}"' if dlm else ""
    method = "" if dlm else 'speculation = "prompt_lookup"'
    path.write_text(f"""
name = "tiny-report"
k = 3
prefill_chunk = 8
context_length = 96
max_prompt_length = 32
max_new_tokens = 16
prompts = ["def f(x):", "import os"]
{method}
[tlm]
model = "{tlm}"
{table}
""")
    return str(path)


ROWS = ["baseline", "MXFP6", "SpD", "MXFP6 + SpD"]


def test_report_measures_figure_7_and_the_draft_free_methods(checkpoints, tmp_path):
    recipe = write_recipe(tmp_path / "r.toml", checkpoints["llama-gqa"], checkpoints["draft"])
    # a fixed draft length: the timed policy may choose not to draft at all on a machine where the
    # tiny TLM's scoring call is dear (seen on an AVX-512 CPU), and then no DLM step is measured
    assert report.main(["--recipe", recipe, "--out", str(tmp_path / "out"), "--warmup", "0",
                        "--bandwidth-gib", "0.125", "--draft-length", "3"]) == 0
    out = tmp_path / "out" / "tiny-report"
    data = json.loads((out / "report.json").read_text())
    assert list(data["configs"]) == [*ROWS, "MXFP6 + prompt lookup", "MXFP6 + lookahead"]
    assert all(r["decode_tokens_per_s"] > 0 and r["pss_mib"] > 0 for r in data["configs"].values())
    assert "acceptance_rate" in data["configs"]["SpD"] and "acceptance_rate" not in data["configs"]["MXFP6"]
    assert data["greedy_spd_equals_ar"] == {name: [True, True] for name in list(data["configs"])[2:]}
    assert data["meta"]["precisions"]["MXFP6 TLM"].startswith("fp6_e2m3")
    spd = data["configs"]["SpD"]
    assert spd["tlm_score_ms"] > 0 and spd["dlm_step_ms"] > 0 and spd["host_ms_per_round"] >= 0
    rows = data["configs"]
    assert rows["baseline"]["tlm_calls_per_token"] == 1.0 and rows["MXFP6"]["dlm_calls_per_token"] == 0.0
    assert 0 < rows["MXFP6 + SpD"]["tlm_calls_per_token"] <= 1.0
    assert rows["SpD"]["dlm_calls_per_token"] > 0
    assert rows["MXFP6"]["weights_read_mb_per_token"] < 0.5 * rows["baseline"]["weights_read_mb_per_token"]
    assert data["meta"]["read_bandwidth_gb_per_s"] > 0.5  # any machine reads faster than this
    assert data["meta"]["machine"]["cpu"] and data["meta"]["machine"]["gpu"] is None
    # the draft policy's cost model: each graph's call, and the host time per call
    costs = data["call_costs_ms"]["mxfp6"]
    assert set(costs) == {"tlm", "dlm", "host_per_call"} and costs["host_per_call"] > 0
    assert all(ms > 0 for role in ("tlm", "dlm") for ms in costs[role].values()) and "decode" in costs["tlm"]
    md = (out / "report.md").read_text()
    assert "| MXFP6 + SpD |" in md and "Where the time goes" in md and "Bandwidth floor" in md
    assert "vs its AR, paired" in md and rows["SpD"]["vs_own_ar"] is None  # 2 prompts: too few pairs
    assert rows["baseline"]["speedup_paired"] is None and rows["MXFP6"]["speedup_paired"] is None
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_report_of_a_recipe_without_a_draft_model(checkpoints, tmp_path):
    """SpD is then the recipe's draft-free method; the other one gets its own row; no DLM is read."""
    recipe = write_recipe(tmp_path / "r.toml", checkpoints["llama-gqa"], None)
    assert report.main(["--recipe", recipe, "--out", str(tmp_path / "out"), "--warmup", "0",
                        "--bandwidth-gib", "0.125"]) == 0
    out = tmp_path / "out" / "tiny-report"
    data = json.loads((out / "report.json").read_text())
    assert list(data["configs"]) == [*ROWS, "MXFP6 + lookahead"]
    assert data["meta"]["dlm"] is None and data["meta"]["speculation"] == "prompt_lookup"
    assert data["greedy_spd_equals_ar"] == {name: [True, True] for name in ROWS[2:] + ["MXFP6 + lookahead"]}
    assert all(r["dlm_calls_per_token"] == 0 for r in data["configs"].values())
    assert "SpD = prompt lookup (no draft model)" in (out / "report.md").read_text()
    assert report.main(["--recipe", recipe, "--out", str(tmp_path / "out"), "--draft-length", "2"]) == 2


def test_report_refuses_an_uncompiled_draft_length_before_any_run(checkpoints, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.toml", checkpoints["llama-gqa"], checkpoints["draft"])
    assert report.main(["--recipe", recipe, "--out", str(tmp_path / "out"), "--draft-length", "5"]) == 2
    assert "error: --draft-length: draft_length 5 is not compiled" in capsys.readouterr().err
    assert not (tmp_path / "out" / "tiny-report" / "report.json").exists()


def test_report_states_missing_weights(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.toml", "no-such/model-a", "no-such/model-b")
    assert report.main(["--recipe", recipe, "--out", str(tmp_path / "out")]) == 2
    data = json.loads((tmp_path / "out" / "tiny-report" / "report.json").read_text())
    assert data["status"] == "missing weights" and data["missing"] == ["no-such/model-a", "no-such/model-b"]
    assert "configs" not in data
    assert "missing" in capsys.readouterr().err


def test_report_marks_configurations_that_do_not_fit(checkpoints, tmp_path, monkeypatch, capsys):
    """With --tlm/--dlm overrides and a machine too small: every row says why, nothing is built."""
    import common.resources as resources

    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 20)
    recipe = write_recipe(tmp_path / "r.toml", "unused/tlm", "unused/dlm")
    assert report.main(["--recipe", recipe, "--out", str(tmp_path / "out"), "--tlm", str(checkpoints["llama-gqa"]),
                        "--dlm", str(checkpoints["draft"])]) == 2
    out = tmp_path / "out" / "tiny-report"
    data = json.loads((out / "report.json").read_text())
    assert data["status"] == "does not fit" and list(data["configs"])[:4] == ROWS
    assert all(row.startswith("does not fit: exporting TLM") and "GiB available" in row
               for row in data["configs"].values())
    assert "| baseline | does not fit" in (out / "report.md").read_text()
    assert not (out / "fp32").exists()


def test_accuracy_scoring_matches_transformers(artifact_dir, checkpoints, tmp_path):
    """Teacher-forced perplexity through the compiled graphs equals transformers' on the same windows, and the
    KL divergence of each position's distribution from a reference's is transformers' KL: zero for the
    reference itself, torch's kl_div for another model's."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import runtime
    from benchmarks.accuracy import Divergence, score

    art = runtime.load_artifact(artifact_dir)
    tokens = np.random.default_rng(0).integers(4, 260, 150)
    divergence = Divergence(tmp_path / "ref.npy", len(tokens) - 1)
    nll, top1, kl = score(art, tokens, divergence)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama-gqa"], attn_implementation="eager").eval()
    window = art.manifest.context_length
    ref_nll, ref_top1, ref_logp = [], [], []
    with torch.no_grad():
        for s in range(0, len(tokens) - 1, window):
            seq = torch.from_numpy(tokens[s : s + window + 1])
            logits = model(seq[None, :-1]).logits[0]
            ref_nll.append(torch.nn.functional.cross_entropy(logits, seq[1:], reduction="none").numpy())
            ref_top1.append(logits.argmax(-1).numpy())
            ref_logp.append(torch.log_softmax(logits.double(), -1))
    assert len(nll) == len(tokens) - 1 and not kl.any()  # the reference's own
    np.testing.assert_allclose(nll, np.concatenate(ref_nll), atol=1e-4)
    assert (top1 == np.concatenate(ref_top1)).all()
    np.testing.assert_allclose(np.asarray(divergence.logp), torch.cat(ref_logp).numpy(), atol=1e-4)
    # another model: its KL from the recorded reference, position by position
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
        other = torch.cat([torch.log_softmax(model(torch.from_numpy(tokens[s : s + window + 1])[None, :-1])
                                             .logits[0].double(), -1) for s in range(0, len(tokens) - 1, window)])
    divergence.start()
    kl = np.concatenate([divergence(other[i : i + 40].numpy()) for i in range(0, len(other), 40)])
    expected = torch.nn.functional.kl_div(other, torch.cat(ref_logp), log_target=True, reduction="none").sum(-1)
    assert kl.min() > 0
    np.testing.assert_allclose(kl, expected.numpy(), rtol=1e-3, atol=1e-6)
    divergence.close()
    assert not (tmp_path / "ref.npy").exists()


def test_weight_bytes_per_call_counts_every_matrix_weight_once(checkpoints, tmp_path):
    """A float32 decode call reads 4 bytes per parameter of every Linear layer (the embedding only gathers a row)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bandwidth import weight_bytes_per_call
    from benchmarks.variants import build_cached
    from recipes import get_recipe

    recipe = get_recipe(write_recipe(tmp_path / "r.toml", checkpoints["llama-gqa"], checkpoints["draft"]))
    art = build_cached(recipe, tmp_path / "art", progress=False)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama-gqa"])
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert weight_bytes_per_call(art, "tlm") == 4 * linear


def test_bandwidth_probe_refuses_an_empty_probe():
    from benchmarks.bandwidth import read_bandwidth_gbs

    with pytest.raises(ValueError, match="gib=0"):
        read_bandwidth_gbs(0)


def test_the_results_plot_refuses_a_report_it_cannot_draw(tmp_path, monkeypatch, capsys):
    """benchmarks.plot draws vs_llamacpp and serve_peers reports; any other JSON is refused by name."""
    import json

    from benchmarks import plot

    good = {"recipe": "r", "cpu": "c", "prompt_tokens": [8], "systems": {"ours:mxfp6": {"median": 10.0}}}
    (tmp_path / "good.json").write_text(json.dumps(good))
    (tmp_path / "other.json").write_text("{}")
    monkeypatch.setattr("sys.argv", ["plot", str(tmp_path / "good.json"), "--out", str(tmp_path / "p.png")])
    plot.main()
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setattr("sys.argv", ["plot", str(tmp_path / "other.json"), "--out", str(tmp_path / "q.png")])
    with pytest.raises(SystemExit):
        plot.main()
    assert "other.json: not a report of vs_llamacpp or serve_peers" in capsys.readouterr().err
    assert not (tmp_path / "q.png").exists()


def test_the_python_docs_are_a_held_out_text_without_a_file():
    from pydoc_data.topics import topics

    from benchmarks.accuracy import PYTHON_DOCS, held_out_texts

    (text,) = held_out_texts(Path(PYTHON_DOCS))
    assert text.startswith(next(iter(topics.values()))) and len(text) > 100_000
    with pytest.raises(FileNotFoundError):
        held_out_texts(Path("pydoc-topics-typo"))


def test_the_licence_texts_leave_out_links_and_the_calibration_prose(tmp_path):
    from benchmarks.accuracy import licence_files
    from recipes.calibration_text import PROSE

    for name in ("MPL-2.0", "GPL-3", PROSE.name):
        (tmp_path / name).write_text(name)
    (tmp_path / "GPL").symlink_to("GPL-3")
    assert [f.name for f in licence_files(tmp_path)] == ["GPL-3", "MPL-2.0"]
    with pytest.raises(FileNotFoundError, match="--text FILE"):
        licence_files(tmp_path / "none")


def test_floor_benchmark_reports_decode_against_the_bandwidth_floor(artifact_dir, capsys):
    from benchmarks import floor

    assert floor.main([str(artifact_dir), "--prompt", "ab", "--new-tokens", "4", "--gib", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 4 and out["decode_tokens_per_s"] > 0 and out["weights_read_per_token_MB"] > 0
    # the fraction is printed to 3 decimals: a small one (a cache-sized probe reads fast) is off by up to 5e-4
    assert out["fraction_of_floor"] == pytest.approx(out["decode_tokens_per_s"] / out["floor_tokens_per_s"], rel=0.02,
                                                     abs=6e-4)


def test_sensitivity_ranks_weight_groups_by_what_mxint8_gains(tmp_path, capsys):
    from benchmarks import sensitivity

    args = ["--recipe", "tiny-stdlib-spd", "--text", "pydoc:topics", "--tokens", "96", "--out", str(tmp_path)]
    assert sensitivity.main(args + ["--by", "kind"]) == 0
    kinds = json.loads((tmp_path / "tiny-stdlib-spd" / "sensitivity.json").read_text())
    assert {r["group"] for r in kinds["rows"]} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    assert [r["gain_per_MB"] for r in kinds["rows"]] == sorted((r["gain_per_MB"] for r in kinds["rows"]), reverse=True)
    assert kinds["base_kl"] > 0 and kinds["base_int8"] == ["lm_head"]
    assert sum(r["kl_gain"] > 0 for r in kinds["rows"]) >= 5  # finer weights, closer to float32 (mostly)
    # Every linear in MXINT8 is closer to float32 than MXFP6 is (4x finer steps): a base with all of
    # them leaves nothing to rank, and its KL is a fraction of the MXFP6 base's.
    assert sensitivity.main(args + ["--base-int8", "proj,lm_head"]) == 0
    all8 = json.loads((tmp_path / "tiny-stdlib-spd" / "sensitivity.json").read_text())
    assert all8["rows"] == [] and all8["base_kl"] < kinds["base_kl"] / 2
    assert sensitivity.main(args + ["--by", "layer"]) == 0
    layers = json.loads((tmp_path / "tiny-stdlib-spd" / "sensitivity.json").read_text())
    assert sum(r["tensors"] for r in layers["rows"]) == sum(r["tensors"] for r in kinds["rows"])
    assert all(r["group"].startswith("layers.") for r in layers["rows"])
    assert "gain/MB" in capsys.readouterr().out
    decoder = 6 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 704)  # stdlib-tlm's decoder linears, in weights
    assert sum(r["extra_MB"] for r in kinds["rows"]) == pytest.approx(decoder * 2 / 8 / 1e6, abs=0.004)  # 8 - 6 bits
    four = tmp_path / "four.toml"  # the same recipe in MXFP4: MXINT8 costs 8 - 4 bits a weight
    four.write_text((Path(__file__).parents[1] / "recipes" / "tiny-stdlib-spd.toml").read_text()
                    .replace('mx_format = "fp6_e2m3"', 'mx_format = "fp4_e2m1"'))
    assert sensitivity.main(["--recipe", str(four), *args[2:], "--by", "kind"]) == 0
    rows = json.loads((tmp_path / "tiny-stdlib-spd" / "sensitivity.json").read_text())["rows"]
    assert sum(r["extra_MB"] for r in rows) == pytest.approx(decoder * 4 / 8 / 1e6, abs=0.004)
    for bad in (["--text", str(tmp_path / "missing.txt")], ["--base-int8", "lm-head"]):  # refused, with a message
        with pytest.raises(SystemExit):
            sensitivity.main(args[:2] + bad)


def test_sensitivity_float_model_is_transformers_own():
    import torch

    from export.calibration import float_model
    from export.loader import load_model, resolve_model_dir

    model_dir = resolve_model_dir("builtin:stdlib-tlm")
    model = float_model(model_dir, 256)
    x = torch.arange(40)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, load_model(model_dir, 256, progress=False)(x).logits)


def test_parallel_builds_leave_both_artifacts_cached(checkpoints, tmp_path, monkeypatch):
    from benchmarks import variants
    from recipes import get_recipe

    recipe = get_recipe(write_recipe(tmp_path / "r.toml", checkpoints["llama-gqa"], None))
    both = {"fp32": variants.variant(recipe, None), "mxfp6": variants.variant(recipe, "fp6_e2m3")}
    report._build_in_parallel(both, tmp_path / "out")

    def rebuilt(*args, **kwargs):
        raise AssertionError("the report's sequential pass rebuilt an artifact the parallel pass had built")

    monkeypatch.setattr(variants, "build_artifact", rebuilt)
    for which, r in both.items():
        assert variants.build_cached(r, tmp_path / "out" / which) == tmp_path / "out" / which
    assert (tmp_path / "out" / "mxfp6" / "manifest.json").is_file()


def test_rows_take_turns_at_each_position(monkeypatch):
    """Rows interleave prompt by prompt in a balanced order: over as many prompts as rows, each row runs
    first once and right after each other row once (what a row inherits from the one before it, caches
    and the box's drift, is spread over all of them)."""
    calls: list[object] = []
    forgotten: list[int] = []

    class Runner:
        def forget(self) -> None:
            forgotten.append(1)

    class Art:
        runners = {"tlm": Runner(), "dlm": Runner()}

    def generate(art, prompt, **kw):
        calls.append(kw["speculative"])
        return prompt

    monkeypatch.setattr(report.runtime, "generate", generate)
    rows = {"a": ("x", False), "b": ("x", True), "c": ("y", "lookahead"), "d": ("y", "draft")}
    prompts = ["p0", "p1", "p2", "p3"]
    runs = report.run_all({"x": Art(), "y": Art()}, rows, prompts, None, warmup=0, repeats=1)
    assert {name: [r for _, r in got] for name, got in runs.items()} == {name: prompts for name in rows}
    assert len(forgotten) == 2 * len(calls)  # every run cold: both models' caches forgotten first
    rounds = [calls[i : i + 4] for i in range(0, 16, 4)]
    pairs = [(r[j], r[j + 1]) for r in rounds for j in range(3)]
    assert len({r[0] for r in rounds}) == 4 and len(set(pairs)) == len(pairs) == 12
    rotated = [[(s + i) % 4 for s in range(4)] for i in range(4)]  # negative control: a plain rotation
    assert len({(o[j], o[j + 1]) for o in rotated for j in range(3)}) < 12
    for n in (2, 3, 5, 6):  # odd n: balanced over 2n rounds
        orders = [report.round_order(n, i) for i in range(2 * n)]
        assert all(sorted(o) == list(range(n)) for o in orders)
        follows = {(o[j], o[j + 1]) for o in orders for j in range(n - 1)}
        assert len(follows) == n * (n - 1)
    assert report.round_order(0, 3) == [] and report.round_order(1, 3) == [0]


def _generations(rates: np.ndarray) -> list:
    """(prompt, result) pairs as run_all makes them, 101 tokens each, decoding at `rates` tokens/s."""
    return [(i, SimpleNamespace(metrics=SimpleNamespace(new_tokens=101, decode_s=100 / r)))
            for i, r in enumerate(rates)]


def _covered(rng, truth: float, pairs: int, sd: float) -> bool:
    base = 80 * np.exp(rng.normal(0, 0.2, pairs))  # prompts differ far more than the noise
    v = report.paired_ratio(_generations(base * truth * np.exp(rng.normal(0, sd, pairs))), _generations(base))
    return v["low"] <= truth <= v["high"]


def test_paired_ratio_interval_covers_95_percent_and_finds_a_slow_row(monkeypatch):
    """The interval holds the true ratio 95% of the time at 8 pairs (a binomial test over 2,000 simulated
    reports); the normal quantile's interval, 9% of the time too narrow at 8 pairs, fails that test;
    a row truly at 0.90x with 3% noise lies wholly below 0.97x, and one at 1.00x does not."""
    rng = np.random.default_rng(0)
    n = 2000
    slow = report.paired_ratio(_generations(80 * 0.90 * np.exp(rng.normal(0, 0.03, 8))), _generations(np.full(8, 80.0)))
    even = report.paired_ratio(_generations(80 * np.exp(rng.normal(0, 0.03, 8))), _generations(np.full(8, 80.0)))
    assert slow["high"] < 0.97 and even["high"] >= 0.97 and slow["pairs"] == even["pairs"] == 8
    assert report.paired_ratio(_generations(np.ones(3)), _generations(np.ones(3))) is None  # under 4 pairs
    hits = sum(_covered(rng, 0.97, 8, 0.05) for _ in range(n))
    assert stats.binomtest(hits, n, 0.95).pvalue > 1e-3
    monkeypatch.setattr(intervals, "t_quantile", lambda p, df: stats.norm.ppf(p))  # negative control
    assert stats.binomtest(sum(_covered(rng, 0.97, 8, 0.05) for _ in range(n)), n, 0.95).pvalue < 1e-3


def test_accuracy_gives_each_ratio_its_interval_and_judges_the_shipped_build(tmp_path, capsys):
    """Every scored row carries a batch-means interval around its exact perplexity ratio; the gate
    judges the recipe as shipped where that build is among the configs, else the exact one."""
    import json

    from benchmarks.accuracy import CONFIGS, config_recipe, main
    from recipes import get_recipe

    chat = get_recipe("smollm2-135m-chat")
    assert config_recipe(chat, CONFIGS["fp6_e2m3 native8 min_error +sensitive8"]).tlm == chat.tlm
    assert config_recipe(chat, CONFIGS["fp6_e2m3 native min_error +sensitive8"]).tlm != chat.tlm  # int16
    assert config_recipe(chat, CONFIGS["fp6_e2m3 native min_error +sensitive8 +nearest"]).tlm != chat.tlm
    four = get_recipe("smollm2-135m-chat-4bit")  # the four-bit recipe is the config its accuracy was measured as
    assert config_recipe(chat, CONFIGS["fp4_e2m1 native8 min_error +mostly6 +head6"]).tlm == four.tlm
    code = main(["--recipe", "tiny-stdlib-spd", "--configs", "fp32,fp6_e2m3 exact spec", "--tokens", "1100",
                 "--answer-tokens", "4", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "tiny-stdlib-spd" / "accuracy.json").read_text())
    fp32, mx = report["rows"][:2]
    assert fp32["ppl_ratio"] == 1.0 and fp32["ppl_interval"]["samples"] == 4
    assert fp32["kl_mean"] == 0 and mx["kl_mean"] > 0 and fp32["bits_per_weight"] == 32  # float32 reads 4 bytes
    assert not list((tmp_path / "tiny-stdlib-spd").glob("*.npy"))  # float32's log-probabilities are gone
    v = mx["ppl_interval"]
    assert v["low"] < mx["ppl_ratio"] < v["high"] and v["ratio"] == pytest.approx(mx["ppl_ratio"], rel=1e-9)
    assert not mx["shipped"] and report["meta"]["gate"].startswith("fp6_e2m3 exact")  # tiny ships native8
    assert code == (0 if mx["ppl_ratio"] <= 1.01 else 1)
    assert f"[{v['low']:.4f}, {v['high']:.4f}]" in capsys.readouterr().out
    # --artifact: any compiled build of the recipe's TLM, scored in the same windows against the same float32
    built = tmp_path / "tiny-stdlib-spd" / "fp6_e2m3-exact-spec"
    main(["--recipe", "tiny-stdlib-spd", "--configs", "fp32", "--tokens", "1100", "--answer-tokens", "4",
          "--artifact", str(built), "--out", str(tmp_path / "again")])
    given = json.loads((tmp_path / "again" / "tiny-stdlib-spd" / "accuracy.json").read_text())["rows"][1]
    assert given["name"] == f"artifact {built}" and given["ppl_ratio"] == mx["ppl_ratio"]
    assert given["top1_agreement"] == mx["top1_agreement"]
    with pytest.raises(SystemExit, match="--artifact .*missing"):
        main(["--recipe", "tiny-stdlib-spd", "--configs", "fp32", "--tokens", "1100", "--answer-tokens", "4",
              "--artifact", str(tmp_path / "missing"), "--out", str(tmp_path / "again")])
    # the plot of accuracy against bits: our build and a peer's point, the float32 references left out
    from benchmarks import accuracy_plot

    report["rows"] += [{"name": "llama.cpp Q6_K", "lowering": "llama.cpp", "format": "Q6_K", "bits_per_weight": 6.9,
                        "kl_mean": 0.01},
                       {"name": "llama.cpp F32", "lowering": "llama.cpp", "format": "F32", "bits_per_weight": 32.0,
                        "kl_mean": 1e-6}]
    title, found = accuracy_plot.points(report)
    assert "tiny-stdlib-spd" in title and [(ours, bits) for _, bits, _, ours in found] == [
        (True, mx["bits_per_weight"]), (False, 6.9)]
    path = tmp_path / "with-peer.json"
    path.write_text(json.dumps(report))
    accuracy_plot.main([str(path), "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit):
        accuracy_plot.main([str(tmp_path / "other.json"), "--out", str(tmp_path / "bad.png")])
    assert "not the report expected here (it lacks meta, rows)" in capsys.readouterr().err


def test_mx_decode_reports_every_engine_against_float32(checkpoints, tmp_path, monkeypatch, capsys):
    """benchmarks.mx_decode end to end on a tiny recipe: each engine's speed, floor and top-1 agreement with float32
    (float32 agrees with itself exactly; the default MX build's greedy tokens are its own)."""
    from benchmarks import mx_decode

    monkeypatch.setenv("MXSPD_CACHE", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path / "r.toml", checkpoints["llama-gqa"], None)
    mx_decode.main(["--recipe", recipe, "--engines", "fp32,mxfp6", "--new-tokens", "6", "--repeats", "1",
                    "--prompt", "def f(x):"])
    engines = json.loads(capsys.readouterr().out)["engines"]
    assert set(engines) == {"fp32", "mxfp6"}
    assert engines["fp32"]["top1_agreement_with_fp32"] == 1.0
    assert 0.0 <= engines["mxfp6"]["top1_agreement_with_fp32"] <= 1.0
    assert engines["mxfp6"]["weights_read_per_token_MB"] < engines["fp32"]["weights_read_per_token_MB"]
    assert all(engines[e]["speculation_equals_autoregressive"] == {"prompt_lookup": True, "lookahead": True}
               for e in engines)
