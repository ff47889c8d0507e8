"""`cadence_fx.tracing`: an export records no Python stack trace per node where torch can leave it
out (`without_stack_traces`), and leaves torch's setting as it found it."""

from __future__ import annotations

import torch

from cadence_fx.tracing import without_stack_traces


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def test_an_export_records_no_stack_trace_where_torch_can_leave_it_out():
    config = torch.fx.config
    settable = hasattr(config, "do_not_emit_stack_traces")  # torch 2.13 has it; 2.11 records them anyway
    with without_stack_traces():
        program = torch.export.export(Scale(), (torch.ones(3),), strict=False)
    calls = [node for node in program.module().graph.nodes if node.op == "call_function"]
    assert len(calls) == 2
    assert [node.meta.get("stack_trace") is None for node in calls] == [settable, settable]


def test_the_setting_is_torchs_again_after_the_block_even_when_it_raises():
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        with without_stack_traces():  # nothing to set: a plain block
            pass
        assert not hasattr(config, "do_not_emit_stack_traces")
        return
    torchs = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = False
    try:
        try:
            with without_stack_traces():
                assert config.do_not_emit_stack_traces is True
                raise KeyError("inside")
        except KeyError:
            pass
        assert config.do_not_emit_stack_traces is False
    finally:
        config.do_not_emit_stack_traces = torchs
