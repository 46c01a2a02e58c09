//! The in-process figures under criterion, idem beside the `idempotent` crate on their
//! memory stores: the bare body, a fresh call and a replay with the small request and
//! with the 4 KiB one, and idem's fingerprint of each; and the hash inside each library's fingerprint
//! (SHA-256 for idem, xxh3 for the peer), for what a replay spends on it; and SHA-256
//! beside BLAKE3 on idem's canonical encoding of requests of 100 B to 64 KiB.
//!
//! ```text
//! cargo bench --manifest-path benches/peers/Cargo.toml --bench in_process
//! ```

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use idem_peer_bench::{
    BASKET, Size, body, charge, idem_call_of, idem_call_sized, peer_call_sized, peer_memory,
};
use idem_runtime::Idem;
use idempotent::fingerprint::{DefaultFingerprintStrategy, FingerprintStrategy};

/// Keys recorded before the replay benches; replays cycle through them.
const REPLAY_KEYS: u64 = 1_000;

fn in_process(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // Each size's replays on stores of their own, recorded before.
    let recorded = |size| {
        let idem = Idem::memory();
        let peer = rt.block_on(async { peer_memory() });
        rt.block_on(async {
            for k in 0..REPLAY_KEYS {
                idem_call_sized(&idem, k, size).await.expect("idem");
                peer_call_sized(&peer, k, size).await.expect("peer");
            }
        });
        (idem, peer)
    };
    // The small request's replays with no fingerprint: the floor of what idem's replay
    // costs apart from hashing the request.
    let idem_unhashed = Idem::memory();
    rt.block_on(async {
        for k in 0..REPLAY_KEYS {
            idem_call_of(&idem_unhashed, k, Size::Small, false)
                .await
                .expect("idem");
        }
    });
    let cycle = AtomicU64::new(0);
    let replay = || cycle.fetch_add(1, Ordering::Relaxed) % REPLAY_KEYS;

    let mut g = c.benchmark_group("call");
    let request = charge(7);
    g.bench_function("bare body", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(body(black_box(&request))) })
    });
    for (size, suffix) in [(Size::Small, ""), (Size::Large, " 4 KiB")] {
        // Each sample on a store of its own, empty at its start: one store kept across
        // samples grows to millions of records, and its table's doublings land in some
        // samples and not others.
        g.bench_function(format!("idem fresh{suffix}"), |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                let idem = Idem::memory();
                let start = Instant::now();
                for k in 0..iters {
                    idem_call_sized(&idem, k, size).await.expect("idem");
                }
                start.elapsed()
            })
        });
        g.bench_function(format!("idempotent fresh{suffix}"), |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                let peer = peer_memory();
                let start = Instant::now();
                for k in 0..iters {
                    peer_call_sized(&peer, k, size).await.expect("peer");
                }
                start.elapsed()
            })
        });
        let (idem, peer) = recorded(size);
        g.bench_function(format!("idem replay{suffix}"), |b| {
            b.to_async(&rt)
                .iter(|| idem_call_sized(&idem, replay(), size))
        });
        g.bench_function(format!("idempotent replay{suffix}"), |b| {
            b.to_async(&rt)
                .iter(|| peer_call_sized(&peer, replay(), size))
        });
    }
    g.bench_function("idem replay, no fingerprint", |b| {
        b.to_async(&rt)
            .iter(|| idem_call_of(&idem_unhashed, replay(), Size::Small, false))
    });
    g.finish();

    let mut g = c.benchmark_group("fingerprint");
    let small = charge(7);
    let large = idem_peer_bench::request(Size::Large, 7);
    let size = serde_json::to_vec(&large).expect("json").len();
    let encoded = idem_runtime::bench::canonical_encoding(&large).expect("encoding");
    println!(
        "the 4 KiB request: {size} bytes of JSON, {} of idem's canonical encoding",
        encoded.len()
    );
    g.bench_function("small request", |b| {
        b.iter(|| idem_runtime::fingerprint(black_box(&small)))
    });
    g.bench_function(format!("{size}-byte request"), |b| {
        b.iter(|| idem_runtime::fingerprint(black_box(&large)))
    });
    g.bench_function(format!("{size}-byte request, SHA-256 only"), |b| {
        b.iter(|| idem_runtime::bench::fingerprint_with_bound(black_box(&large), usize::MAX))
    });
    g.bench_function(
        format!("idempotent's fingerprint of the {size}-byte request"),
        |b| {
            b.iter(|| {
                let json = serde_json::to_vec(black_box(&large)).expect("json");
                DefaultFingerprintStrategy.compute("charge", &json)
            })
        },
    );
    // Each library's encoding of the request alone, before its hash: idem's canonical
    // encoding into the buffer its fingerprint keeps, the peer's JSON.
    g.bench_function(format!("idem's encoding of the {size}-byte request"), |b| {
        b.iter(|| idem_runtime::bench::encoded_len(black_box(&large)))
    });
    // The same request with each line's fields declared in another order than the
    // encoding's (shorter names first): each line is put in order as it is encoded.
    let reordered = Reordered {
        order: 7,
        lines: (0..BASKET as u64)
            .map(|order| ReorderedCharge {
                amount: 4200,
                currency: "EUR",
                customer: "cus_8Jk2LmQ9",
                order,
            })
            .collect(),
    };
    assert_eq!(
        idem_runtime::bench::encoded_len(&reordered),
        idem_runtime::bench::encoded_len(&large)
    );
    g.bench_function(
        format!("idem's encoding of the {size}-byte request, fields out of order"),
        |b| b.iter(|| idem_runtime::bench::encoded_len(black_box(&reordered))),
    );
    g.bench_function(
        format!("idempotent's JSON of the {size}-byte request"),
        |b| b.iter(|| serde_json::to_vec(black_box(&large))),
    );
    // The peer's way made collision resistant: its JSON, then SHA-256.
    g.bench_function(format!("SHA-256 of the {size}-byte request's JSON"), |b| {
        b.iter(|| {
            let json = serde_json::to_vec(black_box(&large)).expect("json");
            <sha2::Sha256 as sha2::Digest>::digest(&json)
        })
    });
    // What the hash alone costs: SHA-256 of idem's canonical encoding of the small
    // request. The peer hashes its JSON with xxh3, a 64-bit hash that is not collision
    // resistant.
    let encoded = idem_runtime::bench::canonical_encoding(&small).expect("encoding");
    g.bench_function(
        format!("sha256 of the small request's {} bytes", encoded.len()),
        |b| b.iter(|| <sha2::Sha256 as sha2::Digest>::digest(black_box(&encoded[..]))),
    );
    g.bench_function("idempotent's fingerprint (JSON, xxh3)", |b| {
        b.iter(|| {
            let json = serde_json::to_vec(black_box(&small)).expect("json");
            DefaultFingerprintStrategy.compute("charge", &json)
        })
    });
    g.finish();

    // SHA-256 beside BLAKE3 on the very bytes idem's fingerprint hashes (its canonical
    // encoding, version byte first) of requests of about 100 B to 64 KiB; and the whole
    // `idem_runtime::fingerprint` of each, encoding included, as shipped and with every
    // part hashed one way.
    let mut g = c.benchmark_group("fingerprint hash");
    for size in [100, 1024, 2048, 4096, 65536] {
        let request = document(size);
        let bytes = idem_runtime::bench::canonical_encoding(&request).expect("encoding");
        assert_eq!(bytes.len(), size);
        g.bench_function(format!("sha256 {size} B"), |b| {
            b.iter(|| <sha2::Sha256 as sha2::Digest>::digest(black_box(&bytes[..])))
        });
        // Incremental, as the fingerprint's builder would use it.
        g.bench_function(format!("blake3 {size} B"), |b| {
            b.iter(|| blake3::Hasher::new().update(black_box(&bytes)).finalize())
        });
        // The same less its last byte: BLAKE3's last 1 KiB chunk is then partial, and
        // a partial chunk's blocks are compressed one after another.
        g.bench_function(format!("blake3 {size} B less 1"), |b| {
            b.iter(|| {
                blake3::Hasher::new()
                    .update(black_box(&bytes[1..]))
                    .finalize()
            })
        });
        // The same bytes copied and padded with zeros to a multiple of 4 KiB, as the
        // fingerprint pads a large part in its own buffer.
        let mut padded = Vec::with_capacity(size + 4096);
        g.bench_function(format!("blake3 {size} B less 1, padded"), |b| {
            b.iter(|| {
                padded.clear();
                padded.extend_from_slice(black_box(&bytes[1..]));
                padded.resize(padded.len().next_multiple_of(4096), 0);
                blake3::hash(&padded)
            })
        });
        g.bench_function(format!("fingerprint {size} B"), |b| {
            b.iter(|| idem_runtime::fingerprint(black_box(&request)))
        });
        g.bench_function(format!("fingerprint {size} B, SHA-256 only"), |b| {
            b.iter(|| idem_runtime::bench::fingerprint_with_bound(black_box(&request), usize::MAX))
        });
        g.bench_function(format!("fingerprint {size} B, BLAKE3 only"), |b| {
            b.iter(|| idem_runtime::bench::fingerprint_with_bound(black_box(&request), 0))
        });
    }
    g.finish();
}

/// The 4 KiB request's lines with their fields declared by name, not in the encoding's
/// order.
#[derive(serde::Serialize)]
struct ReorderedCharge {
    amount: u64,
    currency: &'static str,
    customer: &'static str,
    order: u64,
}

#[derive(serde::Serialize)]
struct Reordered {
    order: u64,
    lines: Vec<ReorderedCharge>,
}

/// A request whose canonical encoding is `size` bytes: an order number and a text field
/// (a note, a document) filled to the size.
#[derive(serde::Serialize)]
struct Document {
    order: u64,
    text: String,
}

fn document(size: usize) -> Document {
    let mut request = Document {
        order: 7,
        text: String::new(),
    };
    let words = "the quick brown fox jumps over the lazy dog ".repeat(size / 40 + 1);
    // The text's length prefix grows with it, so fit the text until the whole is `size`.
    let mut len = size;
    loop {
        request.text = words[..len].to_owned();
        let encoded = idem_runtime::bench::canonical_encoding(&request)
            .expect("encoding")
            .len();
        if encoded == size {
            return request;
        }
        len = len + size - encoded;
    }
}

criterion_group!(benches, in_process);
criterion_main!(benches);
