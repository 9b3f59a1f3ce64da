"""What every benchmark study shares: paths (:mod:`.paths`), device arguments (:mod:`.device`), interleaved timing
(:mod:`.timing`), one script's section of a shared Markdown page and JSON results (:mod:`.pages`), number
formatting (:mod:`.fmt`) and provenance (:mod:`.provenance`).

A study (``benchmarks/<study>/``) imports this package and the library, never another study; this package imports
the library's leaves only (``peftplug.fileio``, ``peftplug.datadir``) and no study.
"""
