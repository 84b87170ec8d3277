"""InFlight: results copied to the host behind the device's work, without waiting for it."""

from __future__ import annotations

import pytest
import torch

from tzrec_bench.service.in_flight import InFlight

BUSY_CYCLES = 2_000_000_000  # about a second of a GPU's clock


def test_cpu_results_are_ready_as_they_are():
    values = torch.arange(5)
    flight = InFlight([values])
    assert flight.ready()
    (got,) = flight.wait()
    assert got.data_ptr() == values.data_ptr()  # not copied
    assert torch.equal(got, values)


def test_nothing_to_wait_for_without_tensors_or_a_cuda_device():
    assert InFlight().ready()
    assert InFlight(device=torch.device("cpu")).wait() == []


@pytest.mark.gpu
def test_on_cuda_the_copy_is_queued_behind_the_work_and_waited_for():
    cuda = torch.device("cuda")
    values = torch.arange(1 << 16, device=cuda)
    for check in (False, True):  # the first round allocates the pinned block and loads
        torch.cuda.synchronize()  # the sleep kernel, either of which may wait for the GPU
        torch.cuda._sleep(BUSY_CYCLES)
        result = values * 3  # queued behind the sleep
        flight = InFlight([result])
        marker = InFlight(device=cuda)  # marks the same work, with no results
        if check:
            assert not flight.ready(), "the results are not there before the work is done"
            assert not marker.ready()
        (got,) = flight.wait()
        assert got.device.type == "cpu" and got.is_pinned()
        assert torch.equal(got, torch.arange(1 << 16) * 3)
        assert flight.ready() and marker.ready()
