"""benchmarks/invariance_cost.py: AVX2 forced caps the libraries that pick their own level."""

from invariance_cost import run_environment


def test_avx2_forced_caps_mkl_and_onednn_too(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    environ = run_environment()
    assert environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_a_level_set_by_hand_is_kept(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512")
    assert run_environment()["MKL_ENABLE_INSTRUCTIONS"] == "AVX512"


def test_without_avx2_forced_nothing_is_capped(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert "MKL_ENABLE_INSTRUCTIONS" not in run_environment()
