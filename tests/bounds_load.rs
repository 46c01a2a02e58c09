//! The replay cache's memory under a stream of fresh calls, measured with a counting
//! allocator: what it holds stays within `replay_cache_bytes` (keys and bookkeeping
//! included), and expired entries go without a read of their keys.
//!
//! The measure is the live heap of the whole process, so this binary holds one test: two
//! runs of the same calls on the same store, with the cache on and off, differ by what
//! the cache holds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use idem_runtime::{Idem, IdemError};

mod common;

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

#[allow(
    unsafe_code,
    reason = "a global allocator is unsafe to implement; this one forwards to `System`"
)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// The cache's budget.
const BUDGET: usize = 64 * 1024;
/// Fresh calls per run: with the cache counting outcome bytes only, every one of them
/// would be kept (some 3 MiB).
const CALLS: usize = 5_000;
/// What the two runs may differ by besides the cache: the heap is the whole process's.
const ALLOWANCE: isize = 16 * 1024;
/// The retention of the second phase's calls.
const SHORT: Duration = Duration::from_millis(500);

/// A fresh call under a 120-byte key, with a 1-byte outcome.
async fn call(idem: &Idem, phase: &str, i: usize, retain: Duration) {
    let key = format!("{phase}{i:0>119}");
    let out = idem
        .operation("op", &key)
        .retain(retain)
        .fingerprint_none()
        .run(|| async { Ok::<u8, IdemError>(1) })
        .await
        .expect("call on the memory store");
    assert_eq!(out, 1);
}

/// The heap grown by `CALLS` fresh calls with long retention (`full`), then, after
/// `CALLS` more with `SHORT` retention have expired, by one more call (`expired`), both
/// measured from before the first phase.
fn run(cache_bytes: usize) -> (isize, isize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let idem = Idem::builder()
            .replay_cache_bytes(cache_bytes)
            // Through the trait: the memory store's own calls skip the cache.
            .store(common::memory_through_trait());
        // Whatever is set up lazily on first use is not the cache.
        for i in 0..16 {
            call(&idem, "w", i, Duration::from_secs(3600)).await;
        }
        let before = live();
        for i in 0..CALLS {
            call(&idem, "a", i, Duration::from_secs(3600)).await;
        }
        let full = live() - before;
        for i in 0..CALLS {
            call(&idem, "b", i, SHORT).await;
        }
        tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
        call(&idem, "c", 0, Duration::from_secs(3600)).await;
        let expired = live() - before;
        (full, expired)
    })
}

#[test]
fn the_replay_cache_holds_no_more_than_its_budget() {
    let (off_full, off_expired) = run(0);
    let (on_full, on_expired) = run(BUDGET);
    let full = on_full - off_full;
    let expired = on_expired - off_expired;
    println!("cache of {BUDGET} bytes: {full} bytes held when full, {expired} after expiry");
    assert!(
        full <= BUDGET as isize + ALLOWANCE,
        "the replay cache holds {full} bytes with a budget of {BUDGET}"
    );
    // The cache is in use: the bound is not met by holding nothing.
    assert!(
        full >= BUDGET as isize / 2,
        "the replay cache holds only {full} bytes of its {BUDGET}: is it on?"
    );
    assert!(
        expired <= ALLOWANCE,
        "the replay cache still holds {expired} bytes after its entries expired"
    );
}
