"""``finetune/train.py`` under real FSDP2 on CPU processes, for tests (launch it with ``accelerate launch --multi_gpu``
and ``ACCELERATE_USE_CPU=1``).

accelerate only picks FSDP on GPUs; on CPU processes it runs DDP. This launcher gives ``finetune.train`` an
Accelerator whose state says FSDP2 (full shard, one unit per ``LlamaDecoderLayer``) over the same gloo group, so
``prepare`` shards the model with ``fully_shard`` and every FSDP-only path of the recipe (DTensor parameters, the
gathered state dict, LoRA merged on an unsharded copy, per-shard best parameters, checkpoints) runs for real.
It refuses to continue when a prepared model holds a parameter that is not a DTensor.

``HFAB_TEST_BEST_IS_HIGHEST_PPL=1`` makes ``train.keep_best`` keep the worst evaluation instead of the best (the
smoke run improves at every step, so the best one would be the last and its restore a no-op).
"""
import os
import sys

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DistributedType

import finetune.train as train_module


class FsdpOnCpuAccelerator(Accelerator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        PartialState().distributed_type = DistributedType.FSDP
        self.state.distributed_type = DistributedType.FSDP
        self.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT")

    def prepare(self, *args, **kwargs):
        from torch.distributed.tensor import DTensor

        prepared = super().prepare(*args, **kwargs)
        for obj in prepared if isinstance(prepared, (tuple, list)) else (prepared,):
            if isinstance(obj, torch.nn.Module):
                plain = [n for n, p in obj.named_parameters() if not isinstance(p, DTensor)]
                if plain:
                    raise RuntimeError(f"FSDP2 left {len(plain)} parameters unsharded, e.g. {plain[:3]}")
        return prepared


def main(argv) -> int:
    train_module.Accelerator = FsdpOnCpuAccelerator
    if os.environ.get("HFAB_TEST_BEST_IS_HIGHEST_PPL") == "1":
        train_module.BestKeeper.score = staticmethod(lambda metrics: metrics["ppl"])
    return train_module.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
