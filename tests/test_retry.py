"""`cluster.recovery.Retry`, the run's one retry helper, on calls that fail as actors do: what it
retries, how often, what it counts and logs, and what it leaves alone."""
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from cluster.recovery import FaultCounts, NotSynced, Retry


class Flaky:
    """A call that fails with `errors`, one per call, then answers 'done'; a recovery that raises
    RayActorError `restarting` times (Ray still restarting the actor) before it passes."""

    def __init__(self, *errors: BaseException, restarting: int = 0):
        self.errors, self.restarting = list(errors), restarting
        self.calls, self.agains, self.recovers = 0, 0, 0

    def call(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"

    def again(self):
        self.agains += 1
        return self.call()

    def recover(self):
        self.recovers += 1
        if self.restarting:
            self.restarting -= 1
            raise RayActorError()


def retry(max_restarts=3, wait_s=5.0):
    faults = FaultCounts()
    return Retry(SimpleNamespace(max_restarts=max_restarts, restart_wait_s=wait_s), faults), faults


def test_a_died_actor_and_a_named_fault_are_recovered_retried_and_counted(caplog):
    helper, faults = retry()
    flaky = Flaky(RayActorError(), NotSynced("worker 0 holds no weights"), restarting=2)
    with caplog.at_level("WARNING", logger="jointrl.recovery"):
        out = helper(flaky.call, again=flaky.again, recover=flaky.recover, retried=(NotSynced,),
                     name="rollout worker 0", counter="worker_restarts")
    assert out == "done" and flaky.calls == 3 and flaky.agains == 2
    assert flaky.recovers == 4  # the first recovery waited out two answers of a restarting actor
    assert faults.as_dict() == {**FaultCounts().as_dict(), "worker_restarts": 2}
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and all(m.startswith("rollout worker 0: ") for m in logged)
    assert "RayActorError (fault 1 of at most 3)" in logged[0] and "NotSynced (fault 2 of at most 3)" in logged[1]


def test_without_again_the_call_itself_is_made_again_and_an_uncounted_helper_counts_nothing():
    helper = Retry(SimpleNamespace(max_restarts=1, restart_wait_s=1.0))
    flaky = Flaky(RayActorError())
    assert helper(flaky.call, recover=flaky.recover, name="reward score", counter=None) == "done"
    assert flaky.calls == 2 and flaky.recovers == 1


def test_faults_beyond_max_restarts_are_raised_after_the_last_allowed_retry():
    helper, faults = retry(max_restarts=2)
    flaky = Flaky(RayActorError(), RayActorError(), RayActorError(error_msg="third"))
    with pytest.raises(RayActorError, match="third"):
        helper(flaky.call, recover=flaky.recover, name="generator", counter="expert_restarts")
    assert flaky.calls == 3 and faults.expert_restarts == 2


def test_what_it_does_not_retry_passes_through_untouched():
    helper, faults = retry()
    flaky = Flaky(NotSynced("not retried here"))
    with pytest.raises(NotSynced):
        helper(flaky.call, recover=flaky.recover, name="weight sync", counter="sync_restarts")
    assert flaky.calls == 1 and flaky.recovers == 0 and faults == FaultCounts()


def test_an_actor_that_failed_in_its_constructor_is_not_waited_for():
    helper, faults = retry()
    flaky = Flaky(RayActorError(actor_init_failed=True))  # Ray does not restart such an actor
    with pytest.raises(RayActorError):
        helper(flaky.call, recover=flaky.recover, name="refiner_0", counter="expert_restarts")
    assert flaky.recovers == 0 and faults.expert_restarts == 0


def test_an_actor_still_restarting_after_restart_wait_s_raises():
    helper, faults = retry(wait_s=0.0)
    flaky = Flaky(RayActorError(), restarting=50)
    with pytest.raises(RayActorError):
        helper(flaky.call, recover=flaky.recover, name="generator", counter="expert_restarts")
    assert flaky.calls == 1 and 1 <= flaky.recovers < 50 and faults.expert_restarts == 1
