"""Studies of the articles' claims: sweep files (grid, tuning, seeds, shards), their reports with paired
intervals and plots, and the probes they record. Built on :mod:`jaxformer.train`; only the CLI imports it."""
