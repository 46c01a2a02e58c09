//! Real contention: many tasks released together on one key, and on many keys.
use crate::common;
use crate::suite;
use common::*;

suite!(many_callers_one_key_run_once, many_keys_run_once_each);

async fn many_callers_one_key_run_once(ctx: Ctx) {
    contend_one_key(&ctx.idem, 64, 20).await;
}

async fn many_keys_run_once_each(ctx: Ctx) {
    const KEYS: usize = 2_000;
    assert_eq!(contend_many_keys(&ctx.idem, KEYS, 4).await, KEYS);
    assert_eq!(ctx.idem.stats().await.unwrap().completed, KEYS as u64);
}
