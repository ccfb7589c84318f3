"""Speed and overhead measurements behind ``asyncrl bench``.

Every benchmark compares ratios measured side by side in one invocation (against the physical
limit or against the alternative a user would run), prints JSON, and writes it to
``bench-results/<name>.json`` in the working directory with the machine, versions and settings it ran with.
Timings are never asserted in tests: these numbers are for people, and docs/performance.md.
"""
