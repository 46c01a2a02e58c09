//! The random and clock source scanner: finds `Uuid::new_v4()`, `SystemTime::now()`,
//! `rand::random()` and their kin anywhere in a key or scope expression, including
//! macro arguments and inline `{name}` captures of locals bound to such values.

use std::collections::BTreeSet;

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::visit::{self, Visit};
use syn::{Error, Expr, Path, Token};

use crate::errors::Errors;

/// What a random or clock source is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Random,
    Clock,
}

/// Whether a path (its segment names, generics left out) names a random or clock source.
///
/// Matching is on paths only: methods (`order.now_serving()`) and fields
/// (`event.created_at`) are not paths and are never flagged, and a path is flagged only
/// by names that mean randomness or the current time in the crates people use
/// (`Uuid::new_v4`, `X::now`, `rand::random`, `thread_rng`, …), so `Uuid::new_v5`
/// or a user's `clock_id()` passes.
pub(crate) fn source(segments: &[&str]) -> Option<Source> {
    let (&first, &last) = (segments.first()?, segments.last()?);

    // Crates whose every item is about randomness.
    if matches!(
        first,
        "fastrand" | "getrandom" | "nanoid" | "cuid" | "cuid2"
    ) {
        return Some(Source::Random);
    }
    // Well-known names, wherever they appear in a path (`rand::rngs::OsRng`, `OsRng`).
    if segments.iter().any(|s| {
        matches!(
            *s,
            "thread_rng" | "ThreadRng" | "OsRng" | "RandomState" | "getrandom"
        )
    }) {
        return Some(Source::Random);
    }
    // `rand::random`, `rand::random_range`, `rand::rng`, ...
    if first == "rand" && segments.len() >= 2 && (last.starts_with("random") || last == "rng") {
        return Some(Source::Random);
    }
    let [.., prev, _] = segments else {
        return None;
    };
    match last {
        // `Uuid::new_v4`, `Uuid::new_v7` (random bits), `Uuid::now_v7`, ...
        "new_v4" | "new_v7" | "now_v1" | "now_v6" | "now_v7" => Some(Source::Random),
        // `SystemTime::now`, `Instant::now`, `Utc::now`, `Local::now`, `Timestamp::now`,
        // `Zoned::now`, `OffsetDateTime::now_utc`, `Local::today`, ...
        "now" | "now_utc" | "now_local" | "today" => Some(Source::Clock),
        // `StdRng::from_entropy`, `SmallRng::from_os_rng`.
        "from_entropy" | "from_os_rng" => Some(Source::Random),
        // `Ulid::new`, `Ksuid::new`, `xid::new`.
        "new" | "generate" | "with_source" if matches!(*prev, "Ulid" | "Ksuid" | "xid" | "Xid") => {
            Some(Source::Random)
        }
        _ => None,
    }
}

/// Which argument is being scanned, for the wording of its errors.
#[derive(Clone, Copy)]
pub(crate) enum Role {
    Key,
    Scope,
    Fingerprint,
}

/// Reports random and clock sources anywhere in `expr`; returns the names it refers to
/// (single-segment paths, identifiers in macro arguments, inline `{name}` captures) and
/// how many sources it reported.
pub(crate) fn scan(expr: &Expr, role: Role, errors: &mut Errors) -> (BTreeSet<String>, usize) {
    let mut scan = Scan {
        role,
        found: Vec::new(),
        names: BTreeSet::new(),
    };
    scan.visit_expr(expr);
    let sources = scan.found.len();
    for error in scan.found {
        errors.push(error);
    }
    (scan.names, sources)
}

struct Scan {
    role: Role,
    found: Vec<Error>,
    names: BTreeSet<String>,
}

impl Scan {
    fn check(&mut self, segments: &[String], leading_colon: bool, tokens: &dyn ToTokens) {
        let refs: Vec<&str> = segments.iter().map(String::as_str).collect();
        if let Some(kind) = source(&refs) {
            let written = format!(
                "{}{}",
                if leading_colon { "::" } else { "" },
                refs.join("::")
            );
            self.flag(tokens, &written, kind);
        }
    }

    fn flag(&mut self, tokens: &dyn ToTokens, written: &str, kind: Source) {
        let what = match kind {
            Source::Random => "a source of randomness",
            Source::Clock => "a read of the clock",
        };
        let message = match self.role {
            Role::Key => format!(
                "`key` must not depend on `{written}`, {what}: a retry would get a new \
                 key and run the effect again; build the key from the request's own identity \
                 (an order id, a message id, a client-sent idempotency key){}",
                if kind == Source::Clock {
                    "; a timestamp carried by the request, such as `event.created_at`, is fine"
                } else {
                    ""
                }
            ),
            Role::Scope => format!(
                "`scope` must not depend on `{written}`, {what}: a retry would land in \
                 a new scope and run the effect again; scope by a stable namespace such as the \
                 tenant or account"
            ),
            Role::Fingerprint => format!(
                "`fingerprint` must not depend on `{written}`, {what}: every retry \
                 would be rejected as a payload mismatch; fingerprint the request's payload"
            ),
        };
        self.found
            .push(Error::new_spanned(tokens.to_token_stream(), message));
    }

    /// Macro arguments that do not parse as expressions (`vec![x; n]`, `json!({..})`):
    /// look for paths in the raw tokens.
    fn scan_tokens(&mut self, tokens: TokenStream) {
        let tts: Vec<TokenTree> = tokens.into_iter().collect();
        let colon2 = |i: usize| {
            matches!((tts.get(i), tts.get(i + 1)), (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                if a.as_char() == ':' && a.spacing() == proc_macro2::Spacing::Joint && b.as_char() == ':')
        };
        let mut i = 0;
        while i < tts.len() {
            if let TokenTree::Group(group) = &tts[i] {
                self.scan_tokens(group.stream());
                i += 1;
                continue;
            }
            let start = i;
            let leading_colon = colon2(i) && matches!(tts.get(i + 2), Some(TokenTree::Ident(_)));
            let mut j = if leading_colon { i + 2 } else { i };
            let mut segments = Vec::new();
            while let Some(TokenTree::Ident(ident)) = tts.get(j) {
                segments.push(ident.unraw().to_string());
                j += 1;
                if colon2(j) && matches!(tts.get(j + 2), Some(TokenTree::Ident(_))) {
                    j += 2;
                } else {
                    break;
                }
            }
            if segments.is_empty() {
                i += 1;
                continue;
            }
            self.names.extend(segments.iter().cloned());
            let path: TokenStream = tts[start..j].iter().cloned().collect();
            self.check(&segments, leading_colon, &path);
            i = j;
        }
    }

    /// Names captured inline by a format string: `{id}`, `{id:?}`, `{:width$}`.
    fn format_captures(&mut self, mac: &syn::Macro, args: &Punctuated<Expr, Token![,]>) {
        let macro_name = mac.path.segments.last().map(|s| s.ident.to_string());
        if matches!(
            macro_name.as_deref(),
            Some(
                "concat"
                    | "stringify"
                    | "include"
                    | "include_str"
                    | "include_bytes"
                    | "env"
                    | "option_env"
            )
        ) {
            return;
        }
        // The format string is the first argument, or the second for `write!(f, ..)`.
        let Some(format) = args.iter().take(2).find_map(|arg| match arg {
            Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        }) else {
            return;
        };
        let named: BTreeSet<String> = args
            .iter()
            .filter_map(|arg| match arg {
                Expr::Assign(a) => simple_ident(&a.left),
                _ => None,
            })
            .collect();
        for name in inline_captures(&format) {
            if !named.contains(&name) {
                self.names.insert(name);
            }
        }
    }
}

/// The identifiers a format string captures from the surrounding scope.
fn inline_captures(format: &str) -> Vec<String> {
    fn is_ident(s: &str) -> bool {
        let s = s.strip_prefix("r#").unwrap_or(s);
        s.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_alphanumeric() || c == '_')
            && s != "_"
    }
    let mut out = Vec::new();
    let mut rest = format;
    while let Some(open) = rest.find(['{', '}']) {
        let after = &rest[open + 1..];
        if rest[open..].starts_with("{{") || rest[open..].starts_with("}}") {
            rest = &after[1..];
            continue;
        }
        if rest.as_bytes()[open] == b'}' {
            rest = after;
            continue;
        }
        let Some(close) = after.find('}') else { break };
        let spec = &after[..close];
        let (arg, format_spec) = spec.split_once(':').unwrap_or((spec, ""));
        let arg = arg.trim();
        if is_ident(arg) {
            out.push(arg.trim_start_matches("r#").to_owned());
        }
        // `{:width$}` and `{:.prec$}` capture too.
        for part in format_spec.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$')) {
            if let Some(name) = part.strip_suffix('$')
                && is_ident(name)
            {
                out.push(name.to_owned());
            }
        }
        rest = &after[close + 1..];
    }
    out
}

impl<'ast> Visit<'ast> for Scan {
    fn visit_path(&mut self, path: &'ast Path) {
        let segments: Vec<String> = path
            .segments
            .iter()
            .map(|s| s.ident.unraw().to_string())
            .collect();
        if path.leading_colon.is_none()
            && let [only] = segments.as_slice()
        {
            self.names.insert(only.clone());
        }
        self.check(&segments, path.leading_colon.is_some(), path);
        // Generic arguments are paths too: `HashMap::<K, V, RandomState>::default()`.
        visit::visit_path(self, path);
    }

    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        // A bare `random()` or `rng()` is `rand`'s, imported; as a value (`rng.next_u64()`)
        // such a name is just a variable.
        if let Expr::Path(func) = &*call.func
            && func.qself.is_none()
            && func.path.leading_colon.is_none()
            && func.path.segments.len() == 1
            && let ident = &func.path.segments[0].ident
            && (ident == "random" || ident == "rng")
        {
            self.flag(&func.path, &ident.to_string(), Source::Random);
        }
        visit::visit_expr_call(self, call);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        // `UNIX_EPOCH.elapsed()` reads the clock through a method.
        if call.method == "elapsed"
            && let Expr::Path(receiver) = &*call.receiver
            && receiver
                .path
                .segments
                .last()
                .is_some_and(|s| s.ident == "UNIX_EPOCH")
        {
            self.flag(call, "UNIX_EPOCH.elapsed", Source::Clock);
        }
        visit::visit_expr_method_call(self, call);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        let parser = Punctuated::<Expr, Token![,]>::parse_terminated;
        match parser.parse2(mac.tokens.clone()) {
            Ok(args) => {
                self.format_captures(mac, &args);
                for arg in &args {
                    match arg {
                        // `format!("{x}", x = value)`: `x` names the argument, it is no reference.
                        Expr::Assign(named) if simple_ident(&named.left).is_some() => {
                            self.visit_expr(&named.right);
                        }
                        _ => self.visit_expr(arg),
                    }
                }
            }
            Err(_) => self.scan_tokens(mac.tokens.clone()),
        }
    }
}

/// `ident` or `&ident`: a store given as a parameter, which is then not fingerprinted.
pub(crate) fn simple_ident(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident().map(ToString::to_string),
        Expr::Reference(r) => simple_ident(&r.expr),
        Expr::Paren(p) => simple_ident(&p.expr),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flagged(path: &str) -> Option<Source> {
        let segments: Vec<&str> = path.trim_start_matches("::").split("::").collect();
        source(&segments)
    }

    #[test]
    fn random_and_clock_paths_are_flagged() {
        for path in [
            "Uuid::new_v4",
            "uuid::Uuid::new_v4",
            "::uuid::Uuid::now_v7",
            "Uuid::new_v7",
            "Uuid::now_v1",
            "rand::random",
            "rand::random_range",
            "rand::rng",
            "rand::thread_rng",
            "thread_rng",
            "OsRng",
            "rand::rngs::OsRng",
            "rand::rngs::ThreadRng",
            "fastrand::u64",
            "fastrand::Rng::new",
            "getrandom",
            "getrandom::fill",
            "getrandom::getrandom",
            "RandomState::new",
            "std::hash::RandomState",
            "std::collections::hash_map::RandomState::new",
            "StdRng::from_entropy",
            "SmallRng::from_os_rng",
            "Ulid::new",
            "ulid::Ulid::new",
            "nanoid::nanoid",
        ] {
            assert_eq!(flagged(path), Some(Source::Random), "{path}");
        }
        for path in [
            "SystemTime::now",
            "std::time::SystemTime::now",
            "Instant::now",
            "tokio::time::Instant::now",
            "Utc::now",
            "chrono::Utc::now",
            "chrono::offset::Local::now",
            "Local::now",
            "Local::today",
            "OffsetDateTime::now_utc",
            "time::OffsetDateTime::now_local",
            "Timestamp::now",
            "jiff::Timestamp::now",
            "Zoned::now",
        ] {
            assert_eq!(flagged(path), Some(Source::Clock), "{path}");
        }
    }

    #[test]
    fn stable_paths_pass() {
        for path in [
            "Uuid::new_v5",
            "Uuid::new_v3",
            "Uuid::from_u128",
            "Uuid::parse_str",
            "Uuid::nil",
            "clock_id",
            "now",
            "random",
            "rng",
            "order",
            "Order::new",
            "Ulid::from_string",
            "StdRng::seed_from_u64",
            "rand::rngs::StdRng::seed_from_u64",
            "format",
            "Instant",
            "SystemTime::UNIX_EPOCH",
            "chrono::Utc",
            "DateTime::parse_from_rfc3339",
            "now::serving",
            "Queue::now_serving",
        ] {
            assert_eq!(flagged(path), None, "{path}");
        }
    }

    fn scan_str(expr: &str) -> (usize, BTreeSet<String>) {
        let expr: Expr = syn::parse_str(expr).unwrap();
        let mut scan = Scan {
            role: Role::Key,
            found: Vec::new(),
            names: BTreeSet::new(),
        };
        scan.visit_expr(&expr);
        (scan.found.len(), scan.names)
    }

    #[test]
    fn sources_are_found_anywhere_in_the_expression() {
        for expr in [
            "Uuid::new_v4()",
            "uuid::Uuid::now_v7().to_string()",
            "(order.id, Uuid::new_v4())",
            "format!(\"{}-{}\", order.id, SystemTime::now().elapsed().unwrap().as_secs())",
            "format!(\"{x}\", x = rand::random::<u64>())",
            "{ let id = Uuid::new_v4(); format!(\"{id}\") }",
            "(|| Instant::now())()",
            "[order.id, thread_rng().gen()]",
            "vec![fastrand::u64(..); 2]",
            "serde_json::json!({ \"id\": Utc::now() })",
            "order.id ^ rand::random::<u64>()",
            "std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos()",
            "HashMap::<u8, u8, RandomState>::default().len()",
            "nanoid::nanoid!()",
            "random::<u64>()",
            "rng().next_u64()",
            "order.id + u64::from(random::<u8>())",
            "x.collect::<std::collections::hash_map::RandomState>()",
        ] {
            assert_eq!(scan_str(expr).0, 1, "{expr}");
        }
    }

    #[test]
    fn stable_expressions_pass() {
        for expr in [
            "order.id",
            "order.created_at",
            "order.now_serving()",
            "clock_id(order)",
            "Uuid::new_v5(&Uuid::NAMESPACE_OID, order.id.as_bytes())",
            "(tenant, order.id, \"charge\")",
            "format!(\"charge:v1:{}\", order.id)",
            "event.timestamp.now()",
            "rng.next_u64()",
            "order.random",
            "order.random()",
        ] {
            assert_eq!(scan_str(expr).0, 0, "{expr}");
        }
    }

    #[test]
    fn names_include_paths_macro_arguments_and_inline_captures() {
        let (_, names) = scan_str("format!(\"{order_id}-{n:>width$}\", n = count)");
        assert!(names.contains("order_id"));
        assert!(names.contains("width"));
        assert!(names.contains("count"));
        assert!(!names.contains("n"), "a named argument is not a capture");
        let (_, names) = scan_str("(self.id, msg.source)");
        assert!(names.contains("self") && names.contains("msg"));
        let (_, names) = scan_str("vec![order; 3]");
        assert!(names.contains("order"));
    }

    #[test]
    fn inline_captures_skip_escapes_and_positions() {
        assert_eq!(
            inline_captures("{{a}} {} {0} {b} {c:?} {:.p$}"),
            ["b", "c", "p"]
        );
        assert_eq!(inline_captures("}}{{"), Vec::<String>::new());
    }
}
