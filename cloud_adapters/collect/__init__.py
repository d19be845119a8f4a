"""The telemetry collector (``xroute telemetry collect``): adapters -> snapshot rows -> appended to a
bundle, atomically. One module per job: :mod:`.config` (what a run asks for), :mod:`.region` (asking
one provider region), :mod:`.merge` (new rows into the tables), :mod:`.commit` (the journaled write
and its recovery), :mod:`.lock` (one collector per directory), :mod:`.run` (one run, its report and
``collect_log.json``), :mod:`.schedule` (a run every N).

One run (:func:`.run.collect_once`):

1. finishes any commit a crash interrupted (see *Writes*), takes the directory's lock and reads the
   tables already there;
2. asks every (provider, region) concurrently for offerings, on-demand and spot prices (spot price
   history since the last collected point), spot availability and quotas; probes the RTT to each
   region's API endpoint; reads the configured pools' utilization. A provider failing, throttling
   or past the run's deadline does not stop the others: each *source*
   (``provider:region/feature``) ends ``ok``, ``stale`` (with the reason; the bundle keeps its last
   good rows), ``unsupported`` (the capability map's reason) or ``skipped``;
3. merges the new rows into the tables (offerings upserted in place, step-function tables appended
   with consecutive repeats dropped, RTT upserted), validates every table against
   :mod:`xroute.schema.telemetry`, and leaves out any new offering it could not price or reach
   (no RTT) rather than write a bundle the loader would refuse;
4. commits the tables and ``collect_log.json`` (the manifest: per-source status, last success,
   reasons, call counts) in one journaled step.

*Writes*: every file is written to a temporary name in the same directory, flushed and fsynced;
a journal (``.commit.json``) listing the renames is fsynced; then the files are moved into place
with ``os.replace`` (Ctrl-C deferred meanwhile) and the journal removed. A crash before the
journal leaves the old bundle; after it, the next run (or :func:`.commit.recover`) completes the renames.
No reader ever sees a half-written table.
"""
