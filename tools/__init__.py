"""Developer tools: tuning, profiling, SASS and Nsight summaries, revision comparisons, and
the GPU runners (``tools/gpu/``). Run from the repository root; see tools/README.md."""
