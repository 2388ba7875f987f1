"""The run: one conversion from top to bottom (:mod:`.convert`), the run loop (:mod:`.runner`) and a part's work.

``convert()`` reads the source, plans, calibrates when asked, opens a backend and hands the work to
:func:`.runner.run`, which prepares the destination, runs every part (:mod:`.work`: read ahead, quantize,
write behind) and finishes the output. :mod:`.distributed` is this process's place in a torchrun job.
"""
