from lightning_sql import EnqueueRolloutRequest


async def test_enqueue_claim_finish(store):
    r = await store.enqueue_rollout({"x": 1})
    ar = await store.dequeue_rollout(worker_id="w")
    assert ar is not None and ar.rollout_id == r.rollout_id
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
    got = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=1)
    assert [x.status for x in got] == ["succeeded"]
    assert len(await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=1)])) == 1
