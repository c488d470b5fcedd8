"""Every published number, from the committed JSON under experiments/results/.

``python -m experiments.tables`` regenerates, from the JSON alone:

* ``docs/results.md`` — the current numbers, grouped by what they measure, each figure with the
  JSON file it is read from and the command that reproduces it;
* the plots (``experiments/results/<experiment>/*.png``);
* ``experiments/results/index.json`` — every headline figure as ``{key, value, unit, device,
  command, source}``;
* the README's results block between ``<!-- results:begin -->`` and ``<!-- results:end -->``.

``python -m experiments.tables --check`` changes nothing and exits 1 if any of them would change.

The figures are declared in ``FIGURES`` (key, unit, source file, and a JSON path or a small
extractor); the command of a source file is the step of ``experiments/suites/*.toml`` whose
``--out`` is that file. This package imports no experiment module: it reads JSON and TOML only.

Its modules, each importing only those above it:

* ``inputs`` — the paths, :func:`~experiments.tables.inputs.load` and the other readers, and every result
  file the tables read (``BENCH_PLAIN``, ``PAIR_SPEED``, ``KNAPSPEC_*`` ...);
* one module per experiment, its tables and notes: ``dustin_quality``, ``kernels`` (attention kernels),
  ``decode`` (AR decode, parity, skip mask, plain stretch, ClassicSD, the demo), ``dustin_speed``,
  ``srh_groups`` (GQA-aware SRHs), ``input_aware_m`` (Dustin's m per round or per length, selection cost),
  ``pair_speed`` (the real pair end to end), ``choice`` (the measured choice between speculation and AR),
  ``knapspec_plans`` (KnapSpec's planner);
* ``figures`` — ``FIGURES``, ``BY_KEY``, ``fmt`` and ``v``;
* ``knapspec`` — KnapSpec end to end (its notes quote figures, so it sits above ``figures``);
* ``plots`` — ``PLOTS``, the registry of plots;
* ``results_md`` — docs/results.md, assembled from all of the above;
* ``regenerate`` — the README block, the index, every output and ``main`` (``__main__`` runs it).

Tests that point the tables at other files patch ``experiments.tables.inputs`` (its ``RESULTS``, ``load``
and ``BENCH_PLAIN``), the one module every other reads them from; those three are not re-exported here.
"""

from experiments.tables import (choice, decode, dustin_quality, dustin_speed, figures, input_aware_m, inputs, kernels,
                                knapspec, knapspec_plans, pair_speed, plots, regenerate, results_md, srh_groups)
from experiments.tables.decode import plain_table
from experiments.tables.dustin_quality import divergence_note
from experiments.tables.figures import BY_KEY, FIGURES, README_KEYS, fmt
from experiments.tables.input_aware_m import m_per_length_held_rows, m_per_length_rows, m_rule_rows
from experiments.tables.inputs import BEGIN, END, KERNEL_DEVICE, TABLE_TAIL_MARGIN, read_path
from experiments.tables.kernels import device_time_note
from experiments.tables.plots import PLOTS, arr_plot, plot_m_rules
from experiments.tables.regenerate import main, readme_with_block

__all__ = ["choice", "decode", "dustin_quality", "dustin_speed", "figures", "input_aware_m", "inputs", "kernels",
           "knapspec", "knapspec_plans", "pair_speed", "plots", "regenerate", "results_md", "srh_groups",
           "BEGIN", "BY_KEY", "END", "FIGURES", "KERNEL_DEVICE", "PLOTS", "README_KEYS", "TABLE_TAIL_MARGIN",
           "arr_plot", "device_time_note", "divergence_note", "fmt", "m_per_length_held_rows", "m_per_length_rows",
           "m_rule_rows", "main",
           "plain_table", "plot_m_rules", "read_path", "readme_with_block"]
