"""The n-gram draft table: counted from a TLM's own answers, shipped in the artifact, drafted from by
prompt lookup where the text offers no match, lossless, and refused when damaged or mismatched."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import runtime
from common.manifest import ArtifactError
from common.ngram_table import FILE, NgramTable, NgramTableError
from common.recipe import PromptLookupSettings, RecipeError, recipe_from_dict
from export.loader import ModelNotFoundError
from export.pipeline import build_artifact
from recipes import ngram_draft
from recipes.default_pair import byte_tokenizer
from runtime.prompt_lookup import TABLE_KIND, draft
from tests.conftest import always_draft, tiny_recipe

PROMPTS = [[0, 7, 8, 9, 10], [0, 20, 21], [0, 30, 31, 32, 33, 34], [0, 40], [0, 50, 51, 52]]


def table_of(sequences, tmp_path, order=3, min_count=1) -> NgramTable:
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    return ngram_draft.table_from_counts(ngram_draft.count(sequences, order, min_count), order, tmp_path / "tok",
                                         260, {"test": True})


def test_count_guess_and_chain_follow_the_most_frequent_continuation(tmp_path):
    sequences = [([0, 1], [5, 6, 7]), ([0, 1], [5, 6, 7]), ([0, 1], [5, 6, 8]), ([0, 2], [9, 6, 4])]
    table = table_of(sequences, tmp_path)
    assert table.guess([3, 5, 6]) == (7, pytest.approx(2 / 3, abs=1e-3))  # context (5, 6): 7 twice, 8 once
    assert table.guess([9, 6]) == (4, 1.0)  # the longest context wins over (6,) -> 7
    assert table.guess([3, 6]) == (7, 0.5)  # (3, 6) unseen: falls back to (6,)
    assert table.guess([77]) is None
    assert table.chain([0, 1], 8, 0.5) == (1.0, [5, 6, 7])  # (0,1)->5, (1,5)->6, (5,6)->7 at 2/3 ...
    assert table.chain([0, 1], 8, 0.7) == (1.0, [5, 6])  # ... which a floor of 0.7 refuses
    assert table.chain([0, 1], 1, 0.5) == (1.0, [5])
    assert ngram_draft.count(sequences, 3, min_count=2).keys() == {(1,), (5,), (6,), (0, 1), (1, 5),
                                                                   (5, 6), (0, 1, 5), (1, 5, 6)}


def test_agreement_counts_right_guesses_per_confidence(tmp_path):
    table = table_of([([0], [5, 6, 7]), ([0], [5, 6, 8])], tmp_path)
    a = ngram_draft.agreement(table, [([0], [5, 6, 7])])
    # positions: after 0 -> 5 (sure, right), after 5 -> 6 (sure, right), after 6 -> 7 (half sure, right)
    assert a["positions"] == 3 and a["guessed"] == 1.0 and a["top1"] == 1.0
    assert a["by_confidence"] == {"0.5": {"share": 1 / 3, "right": 1.0}, "1.0": {"share": 2 / 3, "right": 1.0}}
    assert ngram_draft.agreement(table, [([0], [9, 9])])["top1"] == 0.0


def test_save_load_round_trip_and_damaged_files_are_refused(tmp_path):
    table = table_of([([0, 1], [5, 6, 7]), ([0, 2], [9, 6, 4])], tmp_path)
    table.save(tmp_path / "t.npz")
    back = NgramTable.load(tmp_path / "t.npz")
    assert back.record == {"test": True} and back.vocab_sha256 == table.vocab_sha256
    for ctx in ([0, 1], [9, 6], [6], [1, 5]):
        assert back.guess(ctx) == table.guess(ctx)
    assert not list(tmp_path.glob(".t.npz*"))  # no temporary file left
    raw = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(NgramTableError, match="cannot be read"):
        NgramTable.load(tmp_path / "cut.npz")
    with pytest.raises(NgramTableError, match="does not exist"):
        NgramTable.load(tmp_path / "none.npz")
    np.savez(tmp_path / "obj.npz", contexts=np.array([object()]), next=np.zeros(1), hits=np.zeros(1),
             total=np.zeros(1), meta=np.array("{}"))
    with pytest.raises(NgramTableError, match="cannot be read"):  # never unpickled
        NgramTable.load(tmp_path / "obj.npz")
    arrays = {k: getattr(table, k) for k in ("contexts", "next", "hits", "total")}
    meta = {"format": 1, "order": 3, "vocab_size": 260, "vocab_sha256": table.vocab_sha256}
    for change, words in [({"next": table.next + 1000}, "token ids"), ({"hits": table.total + 1}, "counts"),
                          ({"contexts": table.contexts[:, :2]}, "shapes"), ({"meta": {"format": 1}}, "metadata"),
                          ({"meta": {**meta, "format": 9}}, "format 9"), ({"meta": [1]}, "format None"),
                          ({"total": table.total.astype(np.float32)}, "integers")]:
        given = arrays | {"meta": meta} | change
        np.savez(tmp_path / "bad.npz", **{k: v for k, v in given.items() if k != "meta"},
                 meta=np.array(json.dumps(given["meta"])))
        with pytest.raises(NgramTableError, match=words):
            NgramTable.load(tmp_path / "bad.npz")


def test_a_table_from_another_tokenizer_is_refused(tmp_path):
    table = table_of([([0, 1], [5, 6, 7])], tmp_path)
    table.check_vocabulary(tmp_path / "tok", 260, "the TLM")
    other = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(other))
    with pytest.raises(NgramTableError, match="another tokenizer"):
        table.check_vocabulary(tmp_path / "other", 260, "the TLM")
    with pytest.raises(NgramTableError, match="another tokenizer"):
        table.check_vocabulary(tmp_path / "tok", 300, "the TLM")


def test_another_tlm_exports_without_the_recipes_table_but_a_named_table_is_refused(tmp_path, checkpoints,
                                                                                     caplog):
    """The recipe's table belongs to the recipe's TLM: `--tlm` with another tokenizer drops it with one
    note; the same table named explicitly (--ngram-table) stops the export, leaving no artifact."""
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    other = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(other))
    table = ngram_draft.table_from_counts(ngram_draft.count([([0, 1], [5, 6, 7])], 3, 1), 3, tmp_path / "tok",
                                          260, {})
    table.save(tmp_path / "other.npz")
    recipe = tiny_recipe(dlm=None, context_length=64, ngram_table=str(tmp_path / "other.npz"))
    with caplog.at_level("WARNING", logger="mxspd.export"):
        art = runtime.load_artifact(build_artifact(recipe, tmp_path / "art", tlm=str(checkpoints["llama-gqa"]),
                                                   progress=False))
    assert art.ngram_table is None and not (art.path / FILE).exists()
    notes = [r.getMessage() for r in caplog.records if "another tokenizer" in r.getMessage()]
    assert len(notes) == 1 and "other.npz" in notes[0] and "\n" not in notes[0]
    with pytest.raises(NgramTableError, match="another tokenizer"):
        build_artifact(recipe, tmp_path / "named", tlm=str(checkpoints["llama-gqa"]), progress=False,
                       ngram_table=str(tmp_path / "other.npz"))
    assert not (tmp_path / "named").exists()


def test_draft_prefers_a_long_match_then_the_table_then_a_short_match(tmp_path):
    table = table_of([([0], [5, 6, 7, 8])], tmp_path)
    s = PromptLookupSettings(max_draft=3)
    assert draft([1, 2, 3, 9, 1, 2], s, table) == (2, pytest.approx([3, 9, 1]))  # a 2-token match of the text
    kind, tokens = draft([5, 9, 4, 5], s, table)  # only a 1-token match (5): the table's 5 -> 6 -> 7 -> 8
    assert kind == TABLE_KIND + 10 and tokens.tolist() == [6, 7, 8]
    assert draft([5, 9, 4, 5], replace(s, table=False), table)[0] == 1  # off: the 1-token match
    assert draft([5, 9, 4, 5], s, None)[0] == 1
    assert draft([33, 9, 4, 33], s, table)[0] == 1  # nothing in the table after 33


@pytest.fixture(scope="module")
def with_table(checkpoints, tmp_path_factory):
    """A TLM-only artifact shipping a table counted from its own greedy answers to PROMPTS."""
    root = tmp_path_factory.mktemp("ngram")
    plain = runtime.load_artifact(build_artifact(tiny_recipe(dlm=None, context_length=64), root / "plain",
                                                 tlm=str(checkpoints["llama-gqa"]), progress=False))
    answers = [(p, runtime.generate(plain, p, max_new_tokens=30, speculative=False).token_ids) for p in PROMPTS]
    table = ngram_draft.table_from_counts(ngram_draft.count(answers, 4, 1), 4, plain.path / "tokenizer", 260, {})
    table.save(root / "t.npz")
    recipe = tiny_recipe(dlm=None, context_length=64, speculative=True, speculation="prompt_lookup",
                         ngram_table=str(root / "t.npz"))
    return runtime.load_artifact(build_artifact(recipe, root / "art", tlm=str(checkpoints["llama-gqa"]),
                                                progress=False)), answers


def test_the_table_drafts_losslessly_and_a_disabled_table_does_not(with_table):
    art, answers = with_table
    assert art.ngram_table is not None and FILE in art.manifest.files  # shipped and checksummed
    used = accepted = 0
    for prompt, ar in answers:
        for always in (False, True):
            r = runtime.generate(art, prompt, max_new_tokens=30, prompt_lookup=dict(adaptive=not always))
            assert r.token_ids == ar, prompt
            used += r.metrics.speculative["rounds_with_a_table_guess"]
            accepted += r.metrics.speculative["accepted"]
        off = runtime.generate(art, prompt, max_new_tokens=30, prompt_lookup=dict(table=False, adaptive=False))
        assert off.token_ids == ar and off.metrics.speculative["rounds_with_a_table_guess"] == 0
    assert used > 10 and accepted > 20  # the table knows these answers: its drafts were taken


def test_a_damaged_shipped_table_is_an_artifact_error(with_table, tmp_path):
    import shutil

    art, _ = with_table
    copy = shutil.copytree(art.path, tmp_path / "copy")
    (copy / FILE).write_bytes(b"not a zip")
    with pytest.raises(ArtifactError, match=FILE):
        runtime.load_artifact(copy, verify=False)
    with pytest.raises(ArtifactError):
        runtime.load_artifact(copy)  # the checksum says it first


def test_recipe_and_export_check_the_table_settings(checkpoints, tmp_path):
    base = {"name": "x", "speculation": "prompt_lookup", "tlm": {"model": "m"}}
    assert recipe_from_dict(base | {"ngram_table": "builtin:y"}).ngram_table == "builtin:y"
    for bad in ({"min_confidence": 0}, {"min_confidence": 1.5}, {"table": "yes"}):
        with pytest.raises(RecipeError, match=next(iter(bad))):
            recipe_from_dict(base | {"prompt_lookup": bad})
    recipe = tiny_recipe(dlm=None, context_length=64, ngram_table=str(tmp_path / "missing.npz"))
    with pytest.raises(ModelNotFoundError, match="recipes.ngram_draft"):
        build_artifact(recipe, tmp_path / "art", tlm=str(checkpoints["llama-gqa"]), progress=False)
    assert not (tmp_path / "art").exists()


def test_the_build_command_answers_counts_and_writes_a_record(artifact_dir, tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "r"\nspeculative = false\nchat_template = false\nprompts = ["What is gravity?"]\n'
                      '[tlm]\nmodel = "m"\n')
    out = tmp_path / "t.npz"
    ngram_draft.main(["--recipe", str(recipe), "--artifact", str(artifact_dir), "--limit", "12", "--batch", "1",
                      "--answer-tokens", "8", "--out", str(out)])
    table, record = NgramTable.load(out), json.loads(out.with_suffix(".json").read_text())
    assert record["prompts_counted"] + record["prompts_held_out"] == 12 and record["prompts_held_out"] == 2
    assert 0 < record["tokens_counted"] <= 10 * 8 and len(table) == record["contexts"] > 0
    assert 0 <= record["held_out"]["top1"] <= record["held_out"]["guessed"] <= 1
    assert all(0 <= r["right"] <= 1 for r in record["held_out"]["by_match_length"].values())
    assert "What is gravity?" not in ngram_draft.instructions(exclude=["What is gravity?"])
    assert "contexts from" in capsys.readouterr().out


def test_the_server_scheduler_drafts_from_the_table_too(with_table, monkeypatch):
    from runtime.draft_policy import DraftPolicy
    from runtime.request import batched_speculation, decoding
    from serve.scheduler import Scheduler

    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    art, answers = with_table
    monkeypatch.setattr(art, "eos_token_ids", frozenset())

    def serve(table):
        art.ngram_table, saved = table, art.ngram_table
        scheduler = Scheduler(art)
        try:
            spec = batched_speculation(art, "prompt_lookup", 3)
            reqs = [scheduler.submit(p, decoding(max_new_tokens=30, do_sample=False), spec=spec) for p, _ in answers]
            out = [[e.token for e in r.events() if e.token is not None] for r in reqs]
        finally:
            scheduler.close()
            art.ngram_table = saved
        return out, scheduler.stats["accepted"]

    with_it, accepted = serve(art.ngram_table)
    without, accepted_without = serve(None)  # negative control: the text alone
    assert with_it == without == [a for _, a in answers]
    assert accepted > accepted_without + 20


def test_guess_is_the_longest_counted_context_on_random_text(tmp_path):
    """The packed-int lookup against the counts themselves, on random answers over a small vocabulary."""
    rng = np.random.default_rng(3)
    sequences = [(rng.integers(0, 6, 3).tolist(), rng.integers(0, 6, 30).tolist()) for _ in range(20)]
    counts = ngram_draft.count(sequences, 4, 2)
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    table = ngram_draft.table_from_counts(counts, 4, tmp_path / "tok", 260, {})
    found = 0
    for _ in range(500):
        text = rng.integers(0, 6, int(rng.integers(1, 8))).tolist()
        contexts = [tuple(text[-n:]) for n in range(min(4, len(text)), 0, -1) if tuple(text[-n:]) in counts]
        want = None
        if contexts:
            token, hits = counts[contexts[0]].most_common(1)[0]
            want = (token, hits * 1000 // counts[contexts[0]].total() / 1000)
        assert table.guess(text) == want, text
        found += want is not None
    assert found > 250


def test_table_kinds_start_at_the_tables_held_out_agreement(tmp_path):
    from runtime.draft_policy import DraftPolicy
    from runtime.prompt_lookup import table_priors

    table = table_of([([0], [5, 6])], tmp_path)
    table.record = {"held_out": {"by_confidence": {"0.4": {"share": 0.5, "right": 0.1},
                                                   "0.9": {"share": 0.5, "right": 0.9}},
                                 "by_match_length": {"1": {"share": 0.3, "right": 0.15}}}}
    priors = table_priors(table)
    assert priors[TABLE_KIND + 4] == 0.1 and priors[TABLE_KIND + 9] == 0.9 and table_priors(None) == {}
    assert priors[TABLE_KIND + 6] == 0.6 and len(priors) == 12  # no held-out rate: the confidence itself
    assert priors[1] == 0.15 and 2 not in priors  # a 1-token text match, as measured; 2 tokens: the default
    costs = {1: 1.0, 2: 1.2, 3: 1.3}  # ms of a call of so many rows

    def price(role, rows, warm):
        return costs[rows]

    policy = DraftPolicy("prompt_lookup", price, [1, 2], adapt=False, priors=priors)
    assert policy.choose([(TABLE_KIND + 4, 2)]) == [0]  # right 10% of the time: a plain step is faster
    assert policy.choose([(TABLE_KIND + 9, 2)]) == [2]
    assert policy.choose([(3, 2)])[0] > 0  # a kind without a prior starts at 0.5
    assert DraftPolicy("prompt_lookup", price, [1, 2], adapt=False, prior=0.1).choose([(3, 2)]) == [0]


def test_large_vocabularies_pack_keys_past_int64(tmp_path, monkeypatch):
    """A vocabulary whose (V + 1)^order passes int64 (Llama-3's and Qwen's do at order 4): Python-int keys,
    also for numpy token ids."""
    monkeypatch.setattr(ngram_draft, "vocab_fingerprint", lambda tokenizer_dir: "x")
    big = 2**20
    sequences = [([0], [big - 1, 7, big - 2, 7]), ([0], [big - 1, 7, big - 2, 7])]
    table = ngram_draft.table_from_counts(ngram_draft.count(sequences, 4, 2), 4, Path("unused"), big, {})
    assert table.guess([0, big - 1, 7]) == (big - 2, 1.0)
    assert table.guess(np.array([0, big - 1, 7, big - 2], np.int64)) == (7, 1.0)
    assert table.guess([5, big - 1, 7]) == (big - 2, 1.0)  # (5, V-1, 7) unseen: (V-1, 7) answers


def test_warming_graphs_leaves_the_cache_and_the_text_alone(with_table):
    art, answers = with_table
    prompt, ar = answers[0]
    first = runtime.generate(art, prompt, max_new_tokens=30, speculative=False)
    art.tlm.warm.clear()
    art.tlm.warm_up(art.tlm.graphs)  # every graph runs on padding again
    again = runtime.generate(art, prompt, max_new_tokens=30, speculative=False)
    assert first.token_ids == again.token_ids == ar and again.metrics.cached_prompt_tokens > 0


def test_match_agreement_counts_what_a_text_match_proposed():
    # text 7 8 9 7 8 | answer 9 7 5: after "7 8" (a 2-token match of 7 8 -> 9) comes 9, right; after
    # "7 8 9" (3-token match -> 7) comes 7, right; after "8 9 7" (3-token match -> 8) comes 5, wrong
    rates = ngram_draft.match_agreement([([7, 8, 9, 7, 8], [9, 7, 5])], ngram=3)
    assert rates == {"2": {"share": 1 / 3, "right": 1.0}, "3": {"share": 2 / 3, "right": 0.5}}
