"""Several processes: data parallel under ``accelerate launch`` (:mod:`evollm.parallel.distributed`:
prompt shards, per-member gradient averaging, reduced metrics and fitness, one RNG for selection,
agreement checks) and DeepSpeed ZeRO for a population (:mod:`evollm.parallel.zero`)."""
