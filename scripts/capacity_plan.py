"""The capacity plan of the paper's setup (docs/benchmarks.md, "Capacity plan"): Qwen2.5-VL-3B from
its published config (no download), LoRA and full fine-tuning under ZeRO-3 on 1/2/4/8 GPUs of 40
and 80 GB, memory per GPU and predicted step time, as markdown.

    python scripts/capacity_plan.py [--config cpr_curriculum.yaml]
"""

import sys

from crystal_grpo.train.capacity.paper_plan import main

if __name__ == "__main__":
    sys.exit(main())
