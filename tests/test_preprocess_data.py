"""``pipeexec preprocess-data`` (pipeexec/datasets/preprocess.py): every document is the
tokenizer's own encoding (transformers' ``AutoTokenizer`` on the same folder, an independent
reading of it) with the end-of-document id appended, in input order whatever the worker count;
a .txt corpus is one document per paragraph; a bad line is named by file and line; an
existing output is refused unless --force; a failed run leaves no file behind."""
from __future__ import annotations

import json

import pytest

from data_helpers import make_corpus, make_tokenizer
from pipeexec.cli.main import main
from pipeexec.datasets.indexed import IndexedDataset


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return make_tokenizer(d / "tok", make_corpus(d), 300)


def run(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["preprocess-data", "--no-progress", *args])
    out = capsys.readouterr()
    return exc.value.code, out.out + out.err


def test_documents_are_the_tokenizers_ids_with_eod_in_input_order(tmp_path, tok, capsys):
    from transformers import AutoTokenizer

    corpus = make_corpus(tmp_path, documents=150, seed=4)
    rc, out = run(capsys, "--input", str(corpus), "--tokenizer", str(tok), "--output-prefix",
                  str(tmp_path / "one"))
    assert rc == 0 and "150 documents" in out, out
    rc, out = run(capsys, "--input", str(corpus), "--tokenizer", str(tok), "--output-prefix",
                  str(tmp_path / "two"), "--workers", "2")
    assert rc == 0, out
    hf = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    want = [hf.encode(t, add_special_tokens=False) + [hf.eos_token_id] for t in texts]
    ds = IndexedDataset(tmp_path / "one")
    assert ds.dtype.__name__ == "uint16" and len(ds) == 150
    assert [ds[i].tolist() for i in range(len(ds))] == want
    for ext in (".bin", ".idx"):          # the workers change nothing, byte for byte
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()
    rc, out = run(capsys, "--input", str(corpus), "--tokenizer", str(tok), "--output-prefix",
                  str(tmp_path / "noeod"), "--no-append-eod")
    assert [IndexedDataset(tmp_path / "noeod")[i].tolist() for i in range(3)] == [
        w[:-1] for w in want[:3]]


def test_a_text_file_is_one_document_per_paragraph(tmp_path, tok, capsys):
    from transformers import AutoTokenizer

    (tmp_path / "c.txt").write_text("First paragraph,\nstill the first.\n\n\nSecond one.\n\nThird.")
    rc, out = run(capsys, "--input", str(tmp_path / "c.txt"), "--tokenizer", str(tok),
                  "--output-prefix", str(tmp_path / "t"))
    assert rc == 0, out
    hf = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    paragraphs = ["First paragraph,\nstill the first.\n", "Second one.\n", "Third."]
    ds = IndexedDataset(tmp_path / "t")
    assert [ds[i].tolist() for i in range(len(ds))] == [
        hf.encode(p, add_special_tokens=False) + [hf.eos_token_id] for p in paragraphs]


def test_bad_input_is_named_and_leaves_nothing(tmp_path, tok, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "fine too"}\n{"text": "cut\n')
    rc, out = run(capsys, "--input", str(bad), "--tokenizer", str(tok), "--output-prefix",
                  str(tmp_path / "o"), "--workers", "2")
    assert rc == 2 and f"{bad}: line 4: not JSON" in out, out
    bad.write_text('{"text": "fine"}\n{"body": "x"}\n')
    rc, out = run(capsys, "--input", str(bad), "--tokenizer", str(tok), "--output-prefix",
                  str(tmp_path / "o"))
    assert rc == 2 and "line 2: no key 'text' (--json-keys; it has 'body')" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]     # no output, no tmp
    rc, out = run(capsys, "--input", str(tmp_path / "none.jsonl"), "--tokenizer", str(tok),
                  "--output-prefix", str(tmp_path / "o"))
    assert rc == 2 and "none.jsonl: no such file" in out
    rc, out = run(capsys, "--input", str(bad), "--tokenizer", str(tmp_path / "notok"),
                  "--output-prefix", str(tmp_path / "o"))
    assert rc == 2 and "--tokenizer" in out and "no such folder" in out


def test_an_existing_output_is_refused_unless_forced(tmp_path, tok, capsys):
    corpus = make_corpus(tmp_path, documents=5)
    args = ["--input", str(corpus), "--tokenizer", str(tok), "--output-prefix", str(tmp_path / "o")]
    assert run(capsys, *args)[0] == 0
    rc, out = run(capsys, *args)
    assert rc == 2 and "o.bin, " in out and "exist; pass --force" in out, out
    assert run(capsys, *args, "--force")[0] == 0
    assert len(IndexedDataset(tmp_path / "o")) == 5


def test_several_json_keys_write_one_dataset_each(tmp_path, tok, capsys):
    from transformers import AutoTokenizer

    (tmp_path / "c.jsonl").write_text('{"text": "the body", "title": "a title"}\n'
                                      '{"text": ["two", "sentences"], "title": ""}\n')
    rc, out = run(capsys, "--input", str(tmp_path / "c.jsonl"), "--tokenizer", str(tok),
                  "--output-prefix", str(tmp_path / "o"), "--json-keys", "text", "title",
                  "--workers", "2")
    assert rc == 0, out
    hf = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    enc = lambda t: hf.encode(t, add_special_tokens=False)          # noqa: E731
    text, title = IndexedDataset(tmp_path / "o_text"), IndexedDataset(tmp_path / "o_title")
    eod = hf.eos_token_id
    # a list is one document of two sequences (Megatron's sentences), the eod on the last
    assert [text[i].tolist() for i in range(len(text))] == [
        enc("the body") + [eod], enc("two"), enc("sentences") + [eod]]
    assert text.document_indices.tolist() == [0, 1, 3]
    assert len(title) == 1 and title.document_indices.tolist() == [0, 1, 1]    # "" is empty
