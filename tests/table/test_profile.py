import numpy as np
import pytest

from tierstore import cli
from tierstore.table.hasher import NgramHasher
from tierstore.table.profile import Profile, build_profile
from tierstore.table.spec import preset
from tierstore.errors import InvalidArgument


def test_profile_counts_every_row_read_hottest_first(tmp_path):
    spec = preset("engram-paper-demo", 512)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, size=(2, 64)), rng.integers(0, 50, size=300)]
    prof = build_profile(spec, seqs)
    h = NgramHasher(spec)
    for layer in spec.layer_ids:
        t = spec.table_name(layer)
        allrows = np.concatenate([h.hash(np.asarray(s).reshape(-1, np.asarray(s).shape[-1]), layer).ravel()
                                  for s in seqs])
        u, c = np.unique(allrows, return_counts=True)
        assert prof.counts[t].sum() == allrows.size
        assert np.all(np.diff(prof.counts[t]) <= 0)  # hottest first
        assert dict(zip(prof.ids[t].tolist(), prof.counts[t].tolist())) == dict(zip(u.tolist(), c.tolist()))
    back = Profile.load(prof.save(tmp_path / "p.npz"))
    assert back.tokens == 128 + 300 and back.spec == spec
    assert np.array_equal(back.hot("l1", 5), prof.ids["l1"][:5])
    with pytest.raises(InvalidArgument):
        back.hot("nope")


def test_profile_cli_and_bad_file(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.arange(200) % 17)
    assert cli.main(["profile", str(tmp_path / "t.npy"), "--preset", "engram-paper-demo", "--scale", "512",
                     "--out", str(tmp_path / "p.npz"), "--top", "10"]) == 0
    assert "distinct rows" in capsys.readouterr().out
    assert len(Profile.load(tmp_path / "p.npz").hot("l15")) == 10
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(InvalidArgument, match="tierstore profile"):
        Profile.load(tmp_path / "bad.npz")
