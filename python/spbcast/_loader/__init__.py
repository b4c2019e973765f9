"""The parts of ``spbcast.LeaderLoader`` (python/spbcast/loader.py, the facade that reads as the
story of one step). Each part is an object the facade holds and owns its own fields; what a part
needs of another is passed to it explicitly. The C++ ``leader_loader`` has the same parts under
the same names (include/spbcast/detail/loader/<part>.hpp); docs/internals.md maps them.

- config: the configuration checks, made on every rank before any collective.
- stats: stats() and the summary line.
- patience: keep-alive frames while the leader works, and root_wait.
- step_exchange: the envelope a step sends (status, epoch, step, generator advance, batch),
  errors and refusals, the path batches take.
- generators: the torch generators a loader's order draws from, and counting the default CPU
  generator's advance (the mirror's arithmetic; C++ rng_mirror.hpp).
- resume: the position, what a state holds, state_dict / load_state_dict's decisions, replaying
  a pass, persistent workers, the ResumeWarning decisions.
- leader_calls: the words each call into the loader draws, the leader's calls between steps
  deferred to its next fetch.
- passes: when a pass starts and ends, set_epoch, the fetch loop, carrying out a resume.
- prefetch: the loader's side of prefetch (policy, in-flight jobs, settle / drop, the
  followers' receiving thread); the channel and its thread are spbcast/_prefetch_channel.py.

A part imports only parts before it in this order (python/tests/test_loader_parts.py holds it):

Import order: config < stats < patience < step_exchange < generators < resume < leader_calls < passes < prefetch
"""
