"""`loongforge train --elastic` (train/cli.py hands over here): this node's supervisor follows the
leader, or leads (supervisor.py has the whole picture)."""

from __future__ import annotations

from loongforge.train.resilience.elastic.follower import Follower
from loongforge.train.resilience.elastic.leader import Leader
from loongforge.train.resilience.elastic.supervisor import Supervisor


def supervise(args, raw_argv: list[str]) -> int:
    train_argv = raw_argv[raw_argv.index("train") + 1:] if "train" in raw_argv else raw_argv
    sup = Supervisor(args, train_argv)
    sup.install_signals()
    try:
        if sup.lock.held:
            return Leader(sup).run()
        follower = Follower(sup)
        code = follower.run()
        if code is not None:
            return code
        return Leader(sup, takeover=True, unreported=follower.unreported).run()  # the leader is gone: lead
    finally:
        sup.close()
