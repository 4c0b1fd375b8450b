"""Analyses: a loaded ``Trace`` in, a pandas DataFrame out. They never draw.

Each module exposes one function named like the ``Trace`` method that calls it
(``tracemagic.analysis.layers.layers(trace)`` is ``trace.layers()``). Times are µs;
``ts`` columns are µs since the trace's start (the earliest event over all ranks), so
tables of one trace line up. Every table has a ``rank`` column (0 for single-rank traces).

Column contracts (views rely on these names):

- ``ops()``: ``rank, row, name, kind, ts, dur, self_dur, thread, step, depth, layer,
  input_dims, input_type, seq, rf_id, external_id`` — one row per CPU op / annotation
  (``cpu_op``, ``user_annotation``, ``step``; python_function frames are not ops).
- ``kernels()``: ``rank, row, name, kind (kernel|memcpy|memset), device, stream, ts, dur,
  step, op, layer, correlation, bytes, grid, block, is_comm``.
- ``steps()``: ``rank, step, ts, dur`` and a partition of ``dur``: ``compute_us`` (GPU
  kernels), ``comm_us`` (collectives), ``memcpy_us``, ``memset_us``, ``runtime_us``,
  ``dataloader_us``, ``cpu_us`` (host ops with the GPU idle), ``idle_us``; they add up to
  ``dur``.
- ``ranks()``: ``rank, steps, step_us, compute_us, comm_us, memcpy_us, idle_us,
  overlap_pct, slowest`` (bool: the rank the others wait for most often, see
  ``ranks.stragglers``; not simply the longest step, since waiting lengthens a step).
  Same module: ``collectives(trace)`` (``rank, step, collective, seq, ts, dur,
  arrival_us, wait_us, excess_us, ranks, source``) and ``stragglers(trace)`` (``step,
  rank, by, step_us, median_step_us, wait_us, median_wait_us``).
- ``layers()``: ``rank, layer, type, depth, parent, calls, cpu_us, self_cpu_us, fwd_cpu_us,
  bwd_cpu_us, gpu_us, self_gpu_us, fwd_gpu_us, bwd_gpu_us, memory_growth_bytes,
  input_shapes``; ``df.attrs['unattributed_us']`` and ``df.attrs['step_us']`` per rank.
- ``memory()``: ``rank, ts, device ('cpu' | 'cuda:N'), allocated_bytes, reserved_bytes,
  delta_bytes, op, layer, step``.
- ``shapes()``: ``rank, name, input_dims, input_type, calls, total_us, mean_us, self_us,
  flops, tflops_per_s``.
- ``diff(a, b)``: ``level ('op' | 'kernel' | 'layer'), name, calls_a, calls_b, us_a, us_b,
  delta_us, ratio, status ('added' | 'removed' | 'faster' | 'slower' | 'same')``.
"""
