"""What a manager does with its roots, above one step's files (``io``) and the ranks'
exchanges (``ranks``): the roots and their committed steps (``roots``, ``store``, ``catalog``),
one save (``save_job``) and its writer thread (``write_queue``), one restore's candidate loop
(``restore_job``), the local tier (``local_tier``) and its uploads (``promote``), the peer
copies of a rank's local tier (``peers``: the replication thread ``replication``, the copies
held for peers ``held_copies``, a restore's ``peer_inventory``), and preemption (``preemption``)."""

from .catalog import StepCatalog

__all__ = ["StepCatalog"]
