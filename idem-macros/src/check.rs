//! Validation: turns the parsed arguments and the function's signature into a [`Plan`]
//! that `expand` emits without further questions, or into errors spanned on the
//! offending tokens.

use std::collections::BTreeSet;
use std::time::Duration;

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::visit::{self, Visit};
use syn::{
    Error, Expr, ExprPath, FnArg, Ident, LitStr, Pat, Path, ReturnType, Signature, Token, Type,
};

use crate::attr::{
    self, Arg, Args, Errors, ErrorsArg, FingerprintArg, InFlightArg, StoreErrorArg, TakeoverArg,
};

/// Everything the expansion needs, validated.
pub(crate) struct Plan {
    pub(crate) krate: Path,
    pub(crate) store: Option<Expr>,
    pub(crate) name: String,
    pub(crate) key: Expr,
    pub(crate) scope: Option<Expr>,
    pub(crate) retain: Duration,
    pub(crate) lease: Option<Duration>,
    pub(crate) in_flight: Option<InFlight>,
    pub(crate) on_takeover: Option<TakeoverArg>,
    pub(crate) on_store_error: Option<StoreErrorArg>,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) version: Option<u32>,
    pub(crate) upgrade: Option<ExprPath>,
    pub(crate) on_err: OnErr,
    pub(crate) tx: Option<Ident>,
    /// The declared return type, `Result<T, E>` or an alias of it.
    pub(crate) ret: Type,
}

pub(crate) enum InFlight {
    Wait(Duration),
    Reject,
}

pub(crate) enum Fingerprint {
    /// The default: these bound parameter names, in order.
    Params(Vec<Ident>),
    Expr(Expr),
    None,
}

pub(crate) enum OnErr {
    /// The default; nothing is emitted.
    Release,
    Record,
    Classify(ExprPath),
}

const SIZE_RETAIN: &str = "size it from the longest retry/redelivery horizon of the callers \
     (client retries, queue redelivery, replays), since a retry after it runs the effect again";

/// Validates `args` against the function `sig`.
pub(crate) fn validate(mut args: Args, sig: &Signature) -> syn::Result<Plan> {
    let mut errors = std::mem::take(&mut args.parse_errors);
    // A misspelled argument is reported as such, not again as a missing one.
    let report_missing = errors.is_empty();

    if sig.asyncness.is_none() {
        errors.push(Error::new(
            sig.fn_token.span,
            format!(
                "`#[idempotent]` needs an `async fn`: the claim before the body and the record \
                 after it are awaited; write `async fn {}`",
                sig.ident
            ),
        ));
    }
    let ret = result_type(sig, &mut errors);
    let params = Params::of(sig, &mut errors);

    let key = key(args.key.take(), sig, &params, report_missing, &mut errors);
    let scope = args.scope.take().map(|scope| {
        scan(&scope.value, Role::Scope, &mut errors);
        scope.value
    });
    let retain = match &args.retain {
        Some(retain) => duration(&retain.value, Dur::Retain, &mut errors),
        None => {
            if report_missing {
                errors.push(Error::new(
                    Span::call_site(),
                    format!(
                        "missing `retain`, how long a completed outcome is kept and replayed \
                         (e.g. `retain = \"7d\"`); {SIZE_RETAIN}"
                    ),
                ));
            }
            None
        }
    };
    let lease = args
        .lease
        .as_ref()
        .and_then(|lease| duration(&lease.value, Dur::Lease, &mut errors));
    let in_flight = args.in_flight.as_ref().and_then(|arg| match &arg.value {
        InFlightArg::Wait(lit) => duration(lit, Dur::Wait, &mut errors).map(InFlight::Wait),
        InFlightArg::Reject => Some(InFlight::Reject),
    });
    let name = name(args.name.take(), sig, &mut errors);
    let version = args
        .version
        .take()
        .and_then(|v| version(&v.value, &mut errors));
    let on_err = on_err(args.errors.take(), args.classify.take(), &mut errors);
    if let Some(tx) = &args.tx {
        check_tx(tx, &args, sig, &params, &mut errors);
    }
    let fingerprint = fingerprint(&mut args, params, &mut errors);

    errors.finish()?;
    let (Some(key), Some(retain), Some(ret)) = (key, retain, ret) else {
        unreachable!("a missing `key`, `retain` or return type has been reported");
    };
    Ok(Plan {
        krate: args
            .krate
            .map_or_else(|| syn::parse_quote!(::idem_runtime), |k| k.value),
        store: args.store.map(|s| s.value),
        name,
        key,
        scope,
        retain,
        lease,
        in_flight,
        on_takeover: args.on_takeover.map(|t| t.value),
        on_store_error: args.on_store_error.map(|e| e.value),
        fingerprint,
        version,
        upgrade: args.upgrade.map(|u| u.value),
        on_err,
        tx: args.tx.map(|t| t.value),
        ret,
    })
}

fn key(
    key: Option<Arg<Expr>>,
    sig: &Signature,
    params: &Params,
    report_missing: bool,
    errors: &mut Errors,
) -> Option<Expr> {
    let Some(key) = key else {
        if report_missing {
            errors.push(Error::new(
                Span::call_site(),
                "missing `key`, the operation's identity: one business intent built from the \
                 parameters, e.g. `key = order.id` or `key = (msg.source, msg.id)`",
            ));
        }
        return None;
    };
    let (names, sources) = scan(&key.value, Role::Key, errors);
    // A random key already has its error; "refers to no parameter" would be noise.
    if sources == 0 && !names.iter().any(|n| params.names.contains(n)) {
        errors.push(Error::new_spanned(
            &key.value,
            format!(
                "`key` refers to no parameter of `{}`, so every call would share one key and \
                 only the first would ever run; build it from the parameters that identify the \
                 request, e.g. `key = order.id`",
                sig.ident
            ),
        ));
    }
    Some(key.value)
}

fn name(name: Option<Arg<LitStr>>, sig: &Signature, errors: &mut Errors) -> String {
    match name {
        Some(name) if name.value.value().is_empty() => {
            errors.push(Error::new_spanned(
                &name.value,
                "`name` must not be empty: it is the operation's namespace within the store",
            ));
            String::new()
        }
        Some(name) => name.value.value(),
        None => sig.ident.unraw().to_string(),
    }
}

fn version(lit: &syn::LitInt, errors: &mut Errors) -> Option<u32> {
    match lit.base10_parse::<u32>() {
        Ok(0) => {
            errors.push(Error::new_spanned(
                lit,
                "`version` starts at 1 (the default); bump it when the outcome type changes",
            ));
            None
        }
        Ok(v) => Some(v),
        Err(_) => {
            errors.push(Error::new_spanned(lit, "`version` must fit in a `u32`"));
            None
        }
    }
}

fn on_err(
    errors_arg: Option<Arg<ErrorsArg>>,
    classify: Option<Arg<ExprPath>>,
    errors: &mut Errors,
) -> OnErr {
    match (errors_arg, classify) {
        (Some(errors_arg), Some(classify)) => {
            let later = if errors_arg.index > classify.index {
                errors_arg.span
            } else {
                classify.span
            };
            errors.push(Error::new(
                later,
                "`errors` and `classify` cannot both be given: `classify` decides per error \
                 (`Disposition::Release`, `Record` or `Unknown`); keep one of them",
            ));
            OnErr::Release
        }
        (Some(errors_arg), None) => match errors_arg.value {
            ErrorsArg::Release => OnErr::Release,
            ErrorsArg::Record => OnErr::Record,
        },
        (None, Some(classify)) => OnErr::Classify(classify.value),
        (None, None) => OnErr::Release,
    }
}

/// Transactional mode: `tx` names a parameter, and nothing that needs a lease is given.
fn check_tx(tx: &Arg<Ident>, args: &Args, sig: &Signature, params: &Params, errors: &mut Errors) {
    if !params.names.contains(&tx.value.to_string()) {
        errors.push(Error::new(
            tx.value.span(),
            format!(
                "`tx = {}` names no parameter of `{}`; expected the name of the transaction \
                 parameter, e.g. `tx: &mut sqlx::Transaction<'_, Postgres>`",
                tx.value, sig.ident
            ),
        ));
    }
    let why_no_lease = "in transactional mode the row lock is the claim and rollback is the \
                        release, so there is no lease";
    if let Some(lease) = &args.lease {
        errors.push(Error::new(
            lease.span,
            format!("`lease` cannot be combined with `tx`: {why_no_lease}; remove `lease`"),
        ));
    }
    if let Some(in_flight) = &args.in_flight {
        errors.push(Error::new(
            in_flight.span,
            "`in_flight` cannot be combined with `tx`: a duplicate blocks on the row lock \
             (bounded by the database's `lock_timeout` or `busy_timeout`) and then replays; \
             remove `in_flight`",
        ));
    }
    if let Some(takeover) = &args.on_takeover {
        errors.push(Error::new(
            takeover.span,
            format!(
                "`on_takeover` cannot be combined with `tx`: {why_no_lease} to lapse and no \
                 takeover; remove `on_takeover`"
            ),
        ));
    }
    if let Some(Arg {
        value: StoreErrorArg::FailOpen(span),
        ..
    }) = &args.on_store_error
    {
        errors.push(Error::new(
            *span,
            "`on_store_error = fail_open` cannot be combined with `tx`: the claim is part of the \
             caller's transaction, so the body cannot run without the store; remove it",
        ));
    }
}

/// The given fingerprint, or by default every parameter but the store, `tx` and skipped ones.
fn fingerprint(args: &mut Args, params: Params, errors: &mut Errors) -> Fingerprint {
    match args.fingerprint.take().map(|f| f.value) {
        Some(FingerprintArg::None) => Fingerprint::None,
        Some(FingerprintArg::Expr(expr)) => {
            scan(&expr, Role::Fingerprint, errors);
            Fingerprint::Expr(expr)
        }
        None => {
            let store = args.store.as_ref().and_then(|s| simple_ident(&s.value));
            let tx = args.tx.as_ref().map(|tx| tx.value.to_string());
            Fingerprint::Params(
                params
                    .fingerprinted
                    .into_iter()
                    .filter(|ident| {
                        let name = ident.to_string();
                        Some(&name) != store.as_ref() && Some(&name) != tx.as_ref()
                    })
                    .collect(),
            )
        }
    }
}

/// The declared return type, if it is `Result<T, E>` or an alias named `…Result`.
fn result_type(sig: &Signature, errors: &mut Errors) -> Option<Type> {
    let needs = "`#[idempotent]` needs a return type `Result<T, E>` (with `T: Serialize + \
                 DeserializeOwned` and `E: From<IdemError>`): the outcome is recorded and \
                 replayed, and idem's own failures are returned as `E`";
    match &sig.output {
        ReturnType::Default => {
            errors.push(Error::new(
                sig.ident.span(),
                format!("`{}` returns `()`; {needs}", sig.ident),
            ));
            None
        }
        ReturnType::Type(_, ty) => {
            let mut inner: &Type = ty;
            while let Type::Paren(syn::TypeParen { elem, .. })
            | Type::Group(syn::TypeGroup { elem, .. }) = inner
            {
                inner = elem;
            }
            let is_result = matches!(inner, Type::Path(p)
                if p.qself.is_none()
                    && p.path.segments.last().is_some_and(|s| s.ident.to_string().ends_with("Result")));
            if is_result {
                Some((**ty).clone())
            } else {
                errors.push(Error::new_spanned(ty, needs));
                None
            }
        }
    }
}

/// The function's parameters as the checks see them.
struct Params {
    /// Every bound name, and `self` for a receiver: what a key may refer to.
    names: BTreeSet<String>,
    /// Bound names not marked `#[idem(skip)]`, in order.
    fingerprinted: Vec<Ident>,
}

impl Params {
    fn of(sig: &Signature, errors: &mut Errors) -> Params {
        let mut names = BTreeSet::new();
        let mut fingerprinted = Vec::new();
        for input in &sig.inputs {
            match input {
                FnArg::Receiver(receiver) => {
                    attr::param_skip(&receiver.attrs, errors);
                    names.insert("self".to_owned());
                }
                FnArg::Typed(typed) => {
                    let skip = attr::param_skip(&typed.attrs, errors);
                    let mut bound = Vec::new();
                    bound_idents(&typed.pat, &mut bound);
                    names.extend(bound.iter().map(ToString::to_string));
                    if !skip {
                        fingerprinted.extend(bound);
                    }
                }
            }
        }
        Params {
            names,
            fingerprinted,
        }
    }
}

/// The names a parameter pattern binds: `order`, `(a, b)`, `Parameters(args)`, `Point { x, y }`.
fn bound_idents(pat: &Pat, out: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(p) => {
            out.push(p.ident.clone());
            if let Some((_, sub)) = &p.subpat {
                bound_idents(sub, out);
            }
        }
        Pat::Tuple(p) => p.elems.iter().for_each(|p| bound_idents(p, out)),
        Pat::TupleStruct(p) => p.elems.iter().for_each(|p| bound_idents(p, out)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| bound_idents(&f.pat, out)),
        Pat::Slice(p) => p.elems.iter().for_each(|p| bound_idents(p, out)),
        Pat::Reference(p) => bound_idents(&p.pat, out),
        Pat::Paren(p) => bound_idents(&p.pat, out),
        Pat::Type(p) => bound_idents(&p.pat, out),
        // An or-pattern binds the same names in each alternative.
        Pat::Or(p) => {
            if let Some(first) = p.cases.first() {
                bound_idents(first, out);
            }
        }
        _ => {}
    }
}

/// `ident` or `&ident`: a store given as a parameter, which is then not fingerprinted.
fn simple_ident(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident().map(ToString::to_string),
        Expr::Reference(r) => simple_ident(&r.expr),
        Expr::Paren(p) => simple_ident(&p.expr),
        _ => None,
    }
}

#[derive(Clone, Copy)]
enum Dur {
    Retain,
    Lease,
    Wait,
}

fn duration(lit: &LitStr, which: Dur, errors: &mut Errors) -> Option<Duration> {
    let text = lit.value();
    match humantime::parse_duration(&text) {
        Ok(d) if !d.is_zero() => Some(d),
        Ok(_) => {
            let message = match which {
                Dur::Retain => format!(
                    "`retain` must be longer than zero: an outcome kept for no time is never \
                     replayed; {SIZE_RETAIN}"
                ),
                Dur::Lease => "`lease` must be longer than zero: a claim owned for no time \
                               would be taken over by every duplicate while the body runs"
                    .to_owned(),
                Dur::Wait => "`wait` must be longer than zero; to answer a duplicate at once, \
                              write `in_flight = reject`"
                    .to_owned(),
            };
            errors.push(Error::new_spanned(lit, message));
            None
        }
        Err(e) => {
            let message = match which {
                Dur::Retain => format!(
                    "`retain = {text:?}` is not a duration ({e}); expected e.g. `\"90s\"`, \
                     `\"24h\"`, `\"7d\"` or `\"1h 30m\"`; {SIZE_RETAIN}"
                ),
                Dur::Lease => format!(
                    "`lease = {text:?}` is not a duration ({e}); expected e.g. `\"30s\"` or \
                     `\"5m\"`: how long a running claim is owned before another caller may \
                     take it over"
                ),
                Dur::Wait => format!(
                    "`wait({text:?})` is not a duration ({e}); expected e.g. `wait(\"5s\")`: \
                     how long a duplicate waits for the running call to finish"
                ),
            };
            errors.push(Error::new_spanned(lit, message));
            None
        }
    }
}

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
enum Role {
    Key,
    Scope,
    Fingerprint,
}

/// Reports random and clock sources anywhere in `expr`; returns the names it refers to
/// (single-segment paths, identifiers in macro arguments, inline `{name}` captures) and
/// how many sources it reported.
fn scan(expr: &Expr, role: Role, errors: &mut Errors) -> (BTreeSet<String>, usize) {
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
