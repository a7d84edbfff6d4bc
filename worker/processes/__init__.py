"""Process management: the worker processes a command starts, watches and stops.

* ``supervisor``: run, restart and drain child workers (``serve --replicas N`` / ``--gpus``);
* ``fleet``: the fleet flags of ``serve`` and the child specs the supervisor runs;
* ``tp_group``: the ranks of one tensor-parallel group (``serve --tensor-parallel N``): start-up
  refusals, follower processes, heartbeats, the step deadline ("group" in this package means the
  tensor-parallel group, never the Redis consumer group);
* ``parent_death``: children that stop when their parent dies (``PR_SET_PDEATHSIG``, and a
  watchdog process for children a library starts);
* ``local``: the one launcher of local worker processes (the demo, tests, benchmarks, checks);
* ``tp_local``: a tensor-parallel group of local rank processes (tests, benchmark, GPU check).
"""
