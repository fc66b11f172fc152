"""Megatron's samples, split and blend (pipeexec/datasets): the whole train / validation / test
datasets equal Megatron-Core's own ``BlendedMegatronDatasetBuilder`` + ``GPTDataset`` sample for
sample (one corpus over several epochs, and weighted blends of two), the sample index equals
its C++ ``build_sample_idx`` and the blend its ``build_blending_indices`` (skipped, with the
reason, where megatron-core does not import); without Megatron, a sample is checked against
the token stream it is cut from, and the split against Megatron's own documented examples."""
from __future__ import annotations

import numpy as np
import pytest

from data_helpers import make_corpus, make_tokenizer
from pipeexec.datasets import DataPathError, check_split_for_eval
from pipeexec.datasets.blend import BlendError, blending_indices, parse_data_path
from pipeexec.datasets.build import build_split, data_plan
from pipeexec.datasets.gpt import GPTSamples, sample_index
from pipeexec.datasets.indexed import IndexedDataset
from pipeexec.datasets.preprocess import PreprocessOptions, preprocess
from pipeexec.datasets.split import SplitError, parse_split, split_ranges

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _megatron():
    try:
        from megatron.core.datasets import helpers_cpp
        from megatron.core.datasets.blended_megatron_dataset_builder import \
            BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    except Exception as exc:
        pytest.skip(f"megatron-core does not import here: {type(exc).__name__}: {exc}")
    return helpers_cpp, BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    tok = make_tokenizer(d / "tok", make_corpus(d), 300)
    out = {}
    for seed, n in ((0, 200), (1, 60)):
        c = make_corpus(d, documents=n, seed=seed, name=f"c{seed}.jsonl")
        preprocess(PreprocessOptions(input=str(c), tokenizer=str(tok),
                                     output_prefix=str(d / f"c{seed}"), progress=False))
        out[seed] = str(d / f"c{seed}")
    return out


class _Tok:
    """What Megatron's GPTDataset asks of a tokenizer (pad out of range: no token is masked)."""
    vocab_size, eod, eos, pad = 300, 0, 0, 10 ** 6
    unique_identifiers = {"class": "_Tok"}


@pytest.mark.parametrize("prefixes,weights,split,sizes,seq,seed", [
    ((0,), None, "98,2,0", (300, 10, 0), 16, 3),               # one epoch
    ((0,), None, "90,10,0", (5000, 50, 0), 32, 1),             # 4 epochs, the last kept apart
    ((0,), (1.0,), "98,2,0", (2000, 10, 0), 16, 2),            # a weighted "blend" of one
    ((0, 1), (0.3, 0.7), "90,10,0", (700, 40, 0), 16, 5),      # a blend
    ((0, 1), (2.0, 1.0), "90,8,2", (4000, 40, 8), 8, 0),       # a blend over many epochs
])
def test_samples_equal_megatron_cores_builder(corpora, prefixes, weights, split, sizes, seq, seed):
    _, Builder, GPTDataset, GPTDatasetConfig = _megatron()
    paths = [corpora[p] for p in prefixes]
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=(paths, weights),
                           split=split, tokenizer=_Tok(), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False, path_to_cache=None,
                           mmap_bin_files=True)
    theirs = Builder(GPTDataset, list(sizes), lambda: True, cfg).build()
    items = paths if weights is None else [x for w, p in zip(weights, paths) for x in (str(w), p)]
    plan = data_plan(items, split)
    for k in range(3):
        if theirs[k] is None:
            continue
        ours = build_split(plan, k, seq_len=seq, seed=seed, num_samples=sizes[k])
        assert len(ours) == len(theirs[k])
        for i in range(len(ours)):
            x = theirs[k][i]
            want = np.concatenate([x["tokens"].numpy(), x["labels"].numpy()[-1:]])
            assert ours[i].tolist() == want.tolist(), (k, i)


def test_sample_index_equals_megatrons_cpp(corpora):
    helpers, *_ = _megatron()
    rng = np.random.default_rng(0)
    for trial in range(20):
        lengths = rng.integers(1, 50, rng.integers(1, 30)).astype(np.int32)
        docs = np.arange(len(lengths), dtype=np.int32)
        epochs = int(rng.integers(1, 4))
        doc_index = np.tile(docs, epochs)
        rng.shuffle(doc_index)
        seq = int(rng.integers(2, 20))
        total = int(lengths.sum())
        if epochs * total - 1 < seq:
            continue
        theirs = helpers.build_sample_idx_int32(lengths, doc_index, seq, epochs, total, True, 1)
        assert sample_index(lengths, doc_index, seq).tolist() == theirs.tolist(), trial


def test_blending_equals_megatrons_cpp():
    helpers, *_ = _megatron()
    for weights, size in (([0.5, 0.5], 101), ([0.2, 0.3, 0.5], 1000), ([2 / 3, 1 / 3], 999),
                          ([0.01, 0.99], 500)):
        idx = np.zeros(size, dtype=np.int16)
        within = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(idx, within, np.array(weights), len(weights), size, False)
        ours = blending_indices(weights, size)
        assert ours[0].tolist() == idx.tolist() and ours[1].tolist() == within.tolist()


def test_a_sample_is_the_token_stream_cut_every_seq_len_tokens(corpora):
    """Independent of Megatron: sample j (before the shuffle) is tokens j*s .. j*s + s of the
    documents concatenated in document-index order."""
    ds = IndexedDataset(corpora[1])
    g = GPTSamples(ds, np.arange(len(ds)), seq_len=24, num_samples=500, seed=9)
    stream = np.concatenate([ds[int(d)] for d in g.document_index]).astype(np.int64)
    tokens = int(ds.sequence_lengths.sum())
    assert g.epochs == -(-(500 * 24 + 1) // tokens) > 1          # the fewest epochs that suffice
    assert len(stream) == g.epochs * tokens
    assert len(g) == (len(stream) - 1) // 24 >= 500
    assert sorted(g.shuffle_index.tolist()) == list(range(len(g)))
    for i in (0, 1, 17, len(g) - 1):
        j = int(g.shuffle_index[i])
        assert g[i].tolist() == stream[j * 24: j * 24 + 25].tolist()


def test_split_follows_megatrons_documented_examples():
    # Megatron-Core's parse_and_normalize_split / convert_split_vector_to_split_matrix:
    # "99,1,0" -> [0.99, 0.01, 0.0] -> [(0, 0.99), (0.99, 1.0), None]
    assert parse_split("99,1,0") == pytest.approx((0.99, 0.01, 0.0))
    assert split_ranges(parse_split("99,1,0"), 1000) == ((0, 990), (990, 1000), None)
    assert split_ranges(parse_split("969,30,1"), 200) == ((0, 194), (194, 200), (200, 200))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    for bad, why in (("98,x", "'x' is not a number"), ("0,0,0", "sum to 0"),
                     ("1,2,3,4", "1 to 3"), ("1,-1", ">= 0"), ("nan", "finite")):
        with pytest.raises(SplitError, match=why):
            parse_split(bad)


def test_data_path_items_are_prefixes_or_weight_prefix_pairs(corpora):
    assert parse_data_path(["a"]) == (("a",), None)
    assert parse_data_path(["a", "b", "c"]) == (("a", "b", "c"), None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (("a", "b"), (0.3, 0.7))
    for items, why in ((["0.5", "a", "b"], "mixing numbers"), (["a", "0.5"], "mixing"),
                       (["-1", "a", "2", "b"], "weight of a is -1"),
                       (["0", "a", "0", "b"], "every weight is 0"), ([], "give one or more"),
                       ("a", "as text"), ([1, "a"], "as text")):
        with pytest.raises(BlendError, match=why):
            parse_data_path(items)
    # a weight-0 corpus is dropped from the blend (its files still checked)
    plan = data_plan(["0", corpora[0], "1", corpora[1]], "98,2,0")
    assert plan.prefixes == (corpora[1],) and plan.weights == (1.0,)
    with pytest.raises(DataPathError, match=r"nope\.idx: no such index"):
        data_plan(["0", "nope", "1", corpora[1]], "98,2,0")


def test_an_empty_validation_split_is_refused_for_evaluation(corpora):
    check_split_for_eval([corpora[0]], "98,2,0", 16)
    with pytest.raises(DataPathError, match=r"--eval-interval evaluates on the validation split, "
                       r"which is empty for .*c0 \(--split 100,0,0: its share is 0\)"):
        check_split_for_eval([corpora[0]], "100,0,0", 16)
    # 0.5% of 200 documents is one, of 60 none (59.7 -> 60 .. 60)
    check_split_for_eval([corpora[0]], "995,5,0", 16)
    with pytest.raises(DataPathError, match=r"c1 \(--split 995,5,0: documents 60\.\.60 hold 0 "
                       r"tokens, fewer than one sample of seq_len \+ 1 = 17\)"):
        check_split_for_eval([corpora[0], corpora[1]], "995,5,0", 16)
