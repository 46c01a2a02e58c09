//! What the benches without a driver of their own share: a count from the environment,
//! and the median of their rounds.

/// The environment variable `name` as a count, or `default` where it is unset or does
/// not parse.
pub fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of `v`, which must not be empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
