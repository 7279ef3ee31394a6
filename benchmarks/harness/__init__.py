"""What every benchmark shares: config, inputs, timing, equal cores, the cache daemon, result rows and reports."""
