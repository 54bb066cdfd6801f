"""Model configs read numbers as YAML 1.2 does."""

from pathlib import Path

import yaml

from m31r.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_an_exponent_without_a_dot_or_sign_is_a_number(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads `norm_eps: 1e-5` and `rope_theta: 1.0e4` as strings, and the config refused them as
    "Expected `float`, got `str`"; a hand-written config says 1e-5 more often than 1.0e-5."""
    text = (ROOT / "configs/model/mini.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["norm_eps"] == 1e-5 and data["rope_theta"] == 10000.0
    lines = [ln for ln in text.splitlines() if not ln.startswith(("norm_eps:", "rope_theta:"))]
    f = tmp_path / "model.yaml"
    f.write_text("\n".join(lines + ["norm_eps: 1e-5", "rope_theta: 1.0e4"]) + "\n")
    cfg = load_config(f)
    assert cfg.norm_eps == 1e-5 and cfg.rope_theta == 10000.0
    assert cfg.config_hash() == load_config(ROOT / "configs/model/mini.yaml").config_hash()
