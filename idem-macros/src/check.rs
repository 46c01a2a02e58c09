//! Validation: turns the parsed arguments and the function's signature into a [`Plan`]
//! that `expand` emits without further questions, or into errors spanned on the
//! offending tokens.

use std::collections::BTreeSet;
use std::time::Duration;

use proc_macro2::Span;
use syn::ext::IdentExt;
use syn::{
    Attribute, Error, Expr, ExprPath, FnArg, GenericArgument, Ident, LitStr, Pat, Path,
    PathArguments, ReturnType, Signature, Type, TypeParamBound,
};

use crate::attr::{
    self, Arg, Args, ErrorsArg, FingerprintArg, InFlightArg, StoreErrorArg, TakeoverArg,
};
use crate::errors::Errors;
use crate::scan::{Role, scan, simple_ident};

/// Everything the expansion needs, validated.
pub(crate) struct Plan {
    pub(crate) krate: Path,
    pub(crate) store: Option<Expr>,
    pub(crate) name: String,
    /// No `name = "..."` was given: the name is the function's, and registered as such.
    pub(crate) name_is_default: bool,
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
pub(crate) fn validate(mut args: Args, sig: &Signature, attrs: &[Attribute]) -> syn::Result<Plan> {
    let mut errors = std::mem::take(&mut args.parse_errors);
    // A misspelled argument is reported as such, not again as a missing one.
    let report_missing = errors.is_empty();

    let below_tool = sig.asyncness.is_none()
        && (returns_boxed_future(sig) || attrs.iter().any(|a| is_named(a, "tool")));
    if below_tool {
        // rmcp's `#[tool]` ran first and turned the `async fn` into a `fn` returning a
        // boxed future: the fix is the order of the attributes, not the function.
        errors.push(Error::new(
            sig.fn_token.span,
            format!(
                "`#[idempotent]` must be placed above `#[tool]`: `#[tool]` turns `async fn {0}` \
                 into a `fn` returning a boxed future, which `#[idempotent]` cannot wrap; write \
                 `#[idempotent(...)]` first and `#[tool(...)]` below it, on `async fn {0}`",
                sig.ident
            ),
        ));
    } else if sig.asyncness.is_none() {
        errors.push(Error::new(
            sig.fn_token.span,
            format!(
                "`#[idempotent]` needs an `async fn`: the claim before the body and the record \
                 after it are awaited; write `async fn {}`",
                sig.ident
            ),
        ));
    }
    let ret = if below_tool {
        None
    } else {
        result_type(sig, &mut errors)
    };
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
    let name_is_default = args.name.is_none();
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
        name_is_default,
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

/// Transactional mode: `tx` names a parameter, and nothing that only the leased path
/// does is given. `lease` is allowed: it bounds how long a claim left behind by a
/// cancelled body, in a transaction the caller then committed, blocks its key.
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
            "`on_takeover` cannot be combined with `tx`: the claim is the row lock, held \
             until the transaction ends, and a claim left behind (a cancelled body whose \
             transaction was committed) is always run again once its `lease` lapses; remove \
             `on_takeover`",
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
/// Whether the attribute's last path segment is `name` (`#[tool]`, `#[rmcp::tool(..)]`).
fn is_named(attr: &Attribute, name: &str) -> bool {
    attr.path().segments.last().is_some_and(|s| s.ident == name)
}

/// The first generic type argument of a path type's last segment named `outer`.
fn generic_arg<'a>(ty: &'a Type, outer: &str) -> Option<&'a Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last().filter(|s| s.ident == outer)?;
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    args.args.iter().find_map(|arg| match arg {
        GenericArgument::Type(ty) => Some(ty),
        _ => None,
    })
}

/// `Pin<Box<dyn Future<Output = ..> + ..>>`: the shape rmcp's `#[tool]` rewrites to.
fn returns_boxed_future(sig: &Signature) -> bool {
    let ReturnType::Type(_, ty) = &sig.output else {
        return false;
    };
    let Some(Type::TraitObject(object)) =
        generic_arg(ty, "Pin").and_then(|boxed| generic_arg(boxed, "Box"))
    else {
        return false;
    };
    object.bounds.iter().any(|bound| {
        matches!(bound, TypeParamBound::Trait(t)
            if t.path.segments.last().is_some_and(|s| s.ident == "Future"))
    })
}

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
