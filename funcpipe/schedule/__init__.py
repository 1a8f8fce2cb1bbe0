"""Schedules as data: instructions, programs, generators, passes, checker, simulator, pictures.

Nothing here touches ``torch.distributed`` or :mod:`funcpipe.runtime`: a schedule can be
generated, checked, simulated and drawn without a process group. Measuring real stages
(``profile_stages``, ``measure_stages``, ``measure_memory``) runs the runtime, so it lives above
this package, in :mod:`funcpipe.measure.profile`; what it returns (``StageTimes``, ``StageMemory``,
``Costs``) is data defined here.
"""

from funcpipe.schedule.auto import auto, auto_candidates
from funcpipe.schedule.check import check
from funcpipe.schedule.costs import StageMemory, StageTimes, costs_from_timelines
from funcpipe.schedule.generators import (
    CONSTRAINTS,
    GENERATORS,
    chimera,
    dualpipe_v,
    forward_only,
    generate,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    placement_loop,
    placement_v,
    to_eval,
    zb_h1,
    zb_h2,
    zbv,
)
from funcpipe.schedule.interop import read_csv, write_csv
from funcpipe.schedule.ir import (
    Instr,
    Op,
    Program,
    backward,
    backward_input,
    backward_weight,
    forward,
    gather,
    parse_instr,
    parse_program,
    recompute,
    recv,
    reduce,
    scatter,
    send,
)
from funcpipe.schedule.overlap import overlap
from funcpipe.schedule.passes import (
    add_communication,
    add_recompute,
    add_reduce,
    lower,
    merge_backward,
    split_backward,
    strip_communication,
    weights_after_sends,
)
from funcpipe.schedule.render import ascii_timeline, chrome_trace, draw_timeline, write_chrome_trace
from funcpipe.schedule.simulate import (
    Costs,
    Event,
    Timeline,
    peak_activations,
    peak_memory,
    simulate,
)
from funcpipe.schedule.zero import shard_data

__all__ = [
    "CONSTRAINTS",
    "GENERATORS",
    "Costs",
    "Event",
    "Instr",
    "Op",
    "Program",
    "StageMemory",
    "StageTimes",
    "Timeline",
    "add_communication",
    "add_recompute",
    "add_reduce",
    "ascii_timeline",
    "auto",
    "auto_candidates",
    "backward",
    "backward_input",
    "backward_weight",
    "check",
    "chimera",
    "chrome_trace",
    "costs_from_timelines",
    "draw_timeline",
    "dualpipe_v",
    "forward",
    "forward_only",
    "gather",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "lower",
    "merge_backward",
    "one_f_one_b",
    "overlap",
    "parse_instr",
    "parse_program",
    "peak_activations",
    "peak_memory",
    "placement_loop",
    "placement_v",
    "read_csv",
    "recompute",
    "recv",
    "reduce",
    "scatter",
    "send",
    "shard_data",
    "simulate",
    "split_backward",
    "strip_communication",
    "to_eval",
    "weights_after_sends",
    "write_chrome_trace",
    "write_csv",
    "zb_h1",
    "zb_h2",
    "zbv",
]
