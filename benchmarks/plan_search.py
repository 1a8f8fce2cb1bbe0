"""How long the planner's search takes at cluster scale (issue 35: under a minute).

``python benchmarks/plan_search.py``: the 1T-parameter GPT of Megatron-LM 2021 on 3,072
A100-80GB with a global batch of 3,072 sequences (512 microbatches per pipeline at data 6,
microbatch 1), every schedule, recompute mode, microbatch size, sequence-parallel choice and sharding level;
then the same with a global batch of 1,536 on 3,072 H100s. Prints candidates priced, seconds,
and the best layouts.
"""

from __future__ import annotations

import time

from funcpipe.planner import Transformer, candidates, cluster, search


def main() -> None:
    model = Transformer(layers=128, hidden=25600, heads=160, vocab=51200, seq=2048, flash=False)
    for gpu, batch in (("a100-80gb", 3072), ("h100-sxm", 1536)):
        where = cluster(gpu)
        n = sum(1 for _ in candidates(model, 3072, batch))
        t0 = time.perf_counter()
        best = search(model, where, gpus=3072, global_batch=batch, top=3)
        took = time.perf_counter() - t0
        print(f"{gpu}: 3072 GPUs, global batch {batch}: {n} layouts priced in {took:.1f} s")
        for e in best:
            print(
                f"  {e.layout.short():<40} m={e.microbatches:<4} {e.step_time_s:7.2f} s  "
                f"MFU {e.mfu:.1%}  {e.memory_gib_per_gpu:5.1f} GiB  simulated={e.simulated}"
            )


if __name__ == "__main__":
    main()
