"""The CPU kind that attn_impl = "auto" keys its kernel by (model/cpu_kind.py)."""

from qkvlab.model import cpu_kind as cpu_kind_module
from qkvlab.model.cpu_kind import CPU_KINDS, cpu_kind, kind_of

# /proc/cpuinfo's flags of the machines measured (benchmarks/README.md), trimmed to the kinds'
SAPPHIRE_RAPIDS = "fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"
EPYC_AVX2 = "fpu sse2 avx avx2 fma"


def test_the_best_feature_decides_the_kind():
    assert kind_of(set(SAPPHIRE_RAPIDS.split())) == "amx"
    assert kind_of(set(EPYC_AVX2.split())) == "avx2"
    assert kind_of({"avx2", "avx512f", "avx512_bf16"}) == "avx512-bf16"  # Zen 4, Cooper Lake
    assert kind_of({"avx2", "avx512_f"}) == "avx512"  # torch.cpu.get_capabilities' spelling
    assert kind_of({"neon", "sve"}) == kind_of(set()) == "other"


def test_this_machine_has_a_kind():
    assert cpu_kind() in CPU_KINDS


def test_without_torchs_capabilities_the_flags_come_from_proc_cpuinfo(monkeypatch, tmp_path):
    monkeypatch.delattr(cpu_kind_module.torch.cpu, "get_capabilities", raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {EPYC_AVX2}\n")
    monkeypatch.setattr(cpu_kind_module, "Path", lambda _path: info)
    assert cpu_kind_module._flags() == set(EPYC_AVX2.split())
    monkeypatch.setattr(cpu_kind_module, "Path", lambda _path: tmp_path / "missing")
    assert cpu_kind_module._flags() == set()
