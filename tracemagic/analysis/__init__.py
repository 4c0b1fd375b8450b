"""Analyses: a loaded ``Trace`` in, a pandas DataFrame out. They never draw.

Each module exposes one function named like the ``Trace`` method that calls it
(``tracemagic.analysis.layers.layers(trace)`` is ``trace.layers()``). Times are µs;
``ts`` columns are µs since the trace's start (the earliest event over all ranks), so
tables of one trace line up. Every per-event or per-rank table has a ``rank`` column (0
for single-rank traces). Row columns (``row``, ``op_row``, ``parent``) are positions in
``trace.events``, -1 for none.

The cross-rank tables (``steps``, ``ranks``, ``collectives``, ``stragglers``) are also made
from per-rank summaries (``ranks.summarize`` and ``ranks.*_of``), so that
``tracemagic.load_ranks`` can summarize each rank of a job where it runs; they have the same
columns either way.

Column contracts (views rely on these names; each list is complete and in order, and
``test_analysis_a.py::test_tables_have_exactly_the_documented_columns`` keeps it so):

- ``ops()``: ``rank, row, name, kind, ts, dur, self_dur, thread, step, depth, parent,
  layer, layer_type, input_dims, input_type, seq, rf_id, external_id`` — one row per CPU
  op / annotation (``cpu_op``, ``user_annotation``, ``step``; python_function frames are
  not ops).
- ``kernels()``: ``rank, row, name, kind, device, stream, ts, dur, step, op, op_row, layer,
  layer_type, correlation, bytes, grid, block, collective, is_comm`` — ``kind`` is
  kernel | memcpy | memset.
- ``steps()``: ``rank, step, ts, dur, window_ts, window_dur, compute_us, comm_us,
  memcpy_us, memset_us, runtime_us, dataloader_us, cpu_us, idle_us, gpu_busy_us,
  gpu_idle_us`` — ``ts``/``dur`` are the host ProfilerStep; ``window_ts``/``window_dur``
  the step's device window (the TensorBoard plugin's rule: extended to the end of the GPU
  work the step launched; the host step on CPU-only traces). The window is partitioned by
  ``compute_us`` (GPU kernels), ``comm_us`` (collectives), ``memcpy_us``, ``memset_us``,
  ``runtime_us``, ``dataloader_us``, ``cpu_us`` (host ops with nothing above running),
  ``idle_us``: they add up to ``window_dur``. ``gpu_busy_us`` is the union of all GPU
  activity in the window, ``gpu_idle_us = window_dur - gpu_busy_us`` (NaN without a GPU);
  ``df.attrs['unlaunched']``: {rank: {"events", "us"}} of GPU work in flight when
  profiling began (no launching call in the trace), which belongs to no step.
- ``ranks()`` (``trace.ranks()``): ``rank, steps, step_us, compute_us, comm_us,
  memcpy_us, memset_us, runtime_us, dataloader_us, cpu_us, idle_us, gpu_idle_pct,
  overlap_pct, wait_us, straggler_steps, slowest`` (``step_us`` is the mean device window;
  ``slowest`` is a bool: the rank the others wait for most often, see
  ``ranks.stragglers``; not simply the longest step, since waiting lengthens a step).
- ``collectives()`` (``ranks.collectives``): ``rank, step, collective, seq, ts, dur,
  arrival_us, wait_us, excess_us, ranks, source, bytes, algbw_gbps, busbw_gbps`` (message
  size and the NCCL tests' algorithm and bus bandwidth, GB/s, over the transfer time).
- ``stragglers()`` (``ranks.stragglers``): ``step, rank, by, step_us, median_step_us,
  wait_us, median_wait_us``.
- ``layers()``: ``rank, layer, type, depth, parent, calls, cpu_us, self_cpu_us, fwd_cpu_us,
  fwd_self_cpu_us, bwd_cpu_us, bwd_self_cpu_us, gpu_us, self_gpu_us, fwd_gpu_us,
  bwd_gpu_us, tflops_per_s, memory_bound_pct, memory_growth_bytes, input_shapes, module``
  (``tflops_per_s`` and ``memory_bound_pct`` from ``efficiency()``'s models); ``df.attrs``: ``step_us``,
  ``unattributed_us``, ``overlap_us``, ``gpu_us``, ``gpu_unattributed_us`` (each
  {rank: µs}), ``compiled_regions`` ({rank: torch.compile region calls}),
  ``compiled_layers`` ({rank: [layers running them]}).
- ``layer_spans()`` (``spans.layer_spans``): ``rank, layer, type, phase, ts, dur, step,
  calls``.
- ``memory()``: ``rank, ts, device, allocated_bytes, reserved_bytes, delta_bytes, op,
  op_row, layer, phase, step, addr, row`` — ``device`` is 'cpu' | 'cuda:N'.
- ``memory_peaks()`` (``memory.peaks``): ``rank, device, step, peak_bytes, start_bytes,
  peak_reserved_bytes, ts, op, layer, phase, delta_bytes`` — ``peak_bytes`` is the highest
  ``Total Allocated`` recorded in the step (or the whole capture: ``step`` NA),
  ``start_bytes`` what was already allocated when it began.
- ``biggest_allocations()``: ``rank, ts, device, bytes, op, layer, phase, step, addr,
  freed_ts, lifetime_us``.
- ``memory_categories()`` (``memory.categories``): ``rank, cycle, device, ts,
  before_capture, parameter, optimizer_state, input, temporary, activation, gradient,
  autograd_detail, unknown, total_bytes`` — on the allocator's scale: ``total_bytes``
  equals ``memory()``'s ``allocated_bytes`` at the same time.
- ``shapes()``: ``rank, name, input_dims, input_type, concrete_inputs, calls, total_us,
  mean_us, self_us, gpu_us, flops, tflops_per_s, flops_source`` — one row per top op of
  a call chain (the outermost op with recorded shapes, or with none and none inside, and
  every op it runs: one convolution is one ``aten::conv2d`` row, not four), ranked by
  ``total_us``; ``self_us`` sums the self time of every op of the chains.
- ``efficiency()``: ``rank, name, input_dims, input_type, calls, gpu_us, flops, bytes,
  intensity, tflops_per_s, tbytes_per_s, peak_tflops, peak_tbytes_per_s, bound,
  pct_of_roofline, device`` — one row per (rank, op, input dims, dtypes) of the call chains
  that launched GPU work, most GPU time first; ``flops`` and ``bytes`` per call (as
  ``shapes()``' ``flops``), rates over ``gpu_us``; ``bound`` 'compute' | 'memory'; peaks
  from ``devices.PEAKS`` matched by ``deviceProperties`` (or given); ``df.attrs['layers']``
  the layers of each row's calls.
- ``diff(a, b)``: ``level, name, type, calls_a, calls_b, us_a, us_b, delta_us, ratio,
  status, gpu_us_a, gpu_us_b`` — ``level`` is 'op' | 'kernel' | 'layer', ``status``
  'added' | 'removed' | 'faster' | 'slower' | 'same'; op rows are call-chain tops, as in
  ``shapes()``.
- ``advice()`` (``advice.advice``): ``rule, step, value, threshold, weight, evidence,
  advice, text`` — one row per rule that fired over the scope (``step``: a ProfilerStep,
  NA for the whole trace), by ``weight`` (most important first); ``value`` is the figure
  the rule measured, ``threshold`` the named constant of ``advice`` it reached,
  ``evidence`` the figure as text, ``advice`` what to do, ``text`` the line the views show.
  The figures the views headline (mean step, top ops, kernels and layers, a scope's peaks)
  are ``aggregate``'s.
"""
