"""The GPU clock/temperature/power sampler the benchmarks print next to their figures."""

from __future__ import annotations

import os
import stat
import sys
import time
from datetime import datetime

from tzrec_bench import gpu_state

LINES = (
    "2026/11/21 15:33:27.503, 1815, 57, 689.15\n"
    "2026/11/21 15:33:27.553, 1500, 75, 699.90\n"
    "2026/11/21 15:33:27.603, [N/A], 75, 699.90\n"  # a field nvidia-smi could not read
    "2026/11/21 15:33:27.653, 1650, 76, 701.00\n"
    "2026/11/21 15:33:27.7"  # cut off mid-line
)


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def test_parse_skips_unreadable_and_partial_lines():
    samples = gpu_state.parse_samples(LINES)
    assert [s[1:] for s in samples] == [(1815, 57, 689.15), (1500, 75, 699.9), (1650, 76, 701.0)]
    assert samples[0][0] == _epoch("2026/11/21 15:33:27.503")


def test_summary_covers_only_the_window():
    samples = gpu_state.parse_samples(LINES)
    state = gpu_state.summarize(samples, _epoch("2026/11/21 15:33:27.550"),
                                _epoch("2026/11/21 15:33:27.700"))
    assert state == gpu_state.GpuState(sm_clock_mhz=1575, max_temperature_c=76, power_w=700.45,
                                       samples=2)
    assert state.cell() == "1575 MHz 76 C 700 W"
    assert gpu_state.summarize(samples, 0.0, 1.0) is None


def test_without_nvidia_smi_every_window_is_none(monkeypatch):
    monkeypatch.setattr(gpu_state.shutil, "which", lambda name: None)
    with gpu_state.GpuStateSampler("0") as sampler:
        assert sampler.window(0.0, time.time()) is None


def _stand_in_smi(tmp_path, monkeypatch, instant_reply: str) -> None:
    """A stand-in ``nvidia-smi`` on PATH: one-shot queries of power.draw.instant print
    ``instant_reply`` (``exit:N`` exits with status N); looping queries print a sample every
    20 ms, stamped with the real clock, with the power field they were asked for."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import datetime, sys, time\n"
        "args = ' '.join(sys.argv)\n"
        "if '--loop-ms' not in args:\n"
        f"    reply = {instant_reply!r}\n"
        "    if reply.startswith('exit:'):\n"
        "        print('Field \"power.draw.instant\" is not a valid field to query.')\n"
        "        sys.exit(int(reply[5:]))\n"
        "    print(reply)\n"
        "    sys.exit(0)\n"
        "power = '612.0' if 'power.draw.instant' in args else '650.5'\n"
        "while True:\n"
        "    now = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
        "    print(f'{now}, 1800, 60, {power}', flush=True)\n"
        "    time.sleep(0.02)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_power_field_prefers_the_instant_reading(tmp_path, monkeypatch):
    smi = str(tmp_path / "nvidia-smi")
    _stand_in_smi(tmp_path, monkeypatch, "497.31")
    assert gpu_state.power_field(smi, "0") == "power.draw.instant"
    _stand_in_smi(tmp_path, monkeypatch, "exit:2")  # a driver without the field
    assert gpu_state.power_field(smi, "0") == "power.draw"
    _stand_in_smi(tmp_path, monkeypatch, "[N/A]")  # a GPU that cannot read it
    assert gpu_state.power_field(smi, "0") == "power.draw"
    assert gpu_state.power_field(str(tmp_path / "missing"), "0") == "power.draw"


def test_sampler_reads_a_running_nvidia_smi(tmp_path, monkeypatch):
    _stand_in_smi(tmp_path, monkeypatch, "497.31")
    with gpu_state.GpuStateSampler("0") as sampler:
        time.sleep(0.5)  # the stand-in's interpreter start-up
        start = time.time()
        time.sleep(0.3)
        state = sampler.window(start, time.time())
    assert state is not None and state.samples >= 5
    assert sampler.power_field == "power.draw.instant"
    assert (state.sm_clock_mhz, state.max_temperature_c, state.power_w) == (1800, 60, 612.0)
