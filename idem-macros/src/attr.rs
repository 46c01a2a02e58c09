//! Parsing: the `#[idempotent(...)]` arguments and the `#[idem(...)]` parameter attributes.
//!
//! This phase only reads syntax; what the values mean (durations, conflicts, the key
//! check) is decided in `check`.

use crate::errors::Errors;
use proc_macro2::{Span, TokenTree};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Attribute, Error, Expr, ExprPath, Ident, LitInt, LitStr, Path, Token};

pub(crate) mod kw {
    syn::custom_keyword!(key);
    syn::custom_keyword!(scope);
    syn::custom_keyword!(retain);
    syn::custom_keyword!(store);
    syn::custom_keyword!(name);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(in_flight);
    syn::custom_keyword!(errors);
    syn::custom_keyword!(classify);
    syn::custom_keyword!(on_takeover);
    syn::custom_keyword!(fingerprint);
    syn::custom_keyword!(tx);
    syn::custom_keyword!(on_store_error);
    syn::custom_keyword!(version);
    syn::custom_keyword!(upgrade);

    syn::custom_keyword!(wait);
    syn::custom_keyword!(reject);
    syn::custom_keyword!(release);
    syn::custom_keyword!(record);
    syn::custom_keyword!(rerun);
    syn::custom_keyword!(unknown);
    syn::custom_keyword!(none);
    syn::custom_keyword!(fail_closed);
    syn::custom_keyword!(fail_open);
}

/// Every argument name, in the order the docs list them (for "expected one of" messages).
const ARGUMENTS: &[&str] = &[
    "key",
    "scope",
    "retain",
    "store",
    "name",
    "lease",
    "in_flight",
    "errors",
    "classify",
    "on_takeover",
    "fingerprint",
    "tx",
    "on_store_error",
    "version",
    "upgrade",
    "crate",
];

/// One given argument: the span of its name (for errors about the argument as a whole),
/// its position among the arguments (a conflict is reported at the later one) and its value.
pub(crate) struct Arg<T> {
    pub(crate) span: Span,
    pub(crate) index: usize,
    pub(crate) value: T,
}

pub(crate) enum InFlightArg {
    Wait(LitStr),
    Reject,
}

pub(crate) enum ErrorsArg {
    Release,
    Record,
}

pub(crate) enum TakeoverArg {
    Rerun,
    Unknown,
}

pub(crate) enum StoreErrorArg {
    FailClosed,
    /// The span of `fail_open`, where a conflict with `tx` is reported.
    FailOpen(Span),
}

pub(crate) enum FingerprintArg {
    None,
    Expr(Expr),
}

/// The arguments as written; `None` is "not given".
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Option<Arg<Expr>>,
    pub(crate) scope: Option<Arg<Expr>>,
    pub(crate) retain: Option<Arg<LitStr>>,
    pub(crate) store: Option<Arg<Expr>>,
    pub(crate) name: Option<Arg<LitStr>>,
    pub(crate) lease: Option<Arg<LitStr>>,
    pub(crate) in_flight: Option<Arg<InFlightArg>>,
    pub(crate) errors: Option<Arg<ErrorsArg>>,
    pub(crate) classify: Option<Arg<ExprPath>>,
    pub(crate) on_takeover: Option<Arg<TakeoverArg>>,
    pub(crate) fingerprint: Option<Arg<FingerprintArg>>,
    pub(crate) tx: Option<Arg<Ident>>,
    pub(crate) on_store_error: Option<Arg<StoreErrorArg>>,
    pub(crate) version: Option<Arg<LitInt>>,
    pub(crate) upgrade: Option<Arg<ExprPath>>,
    pub(crate) krate: Option<Arg<Path>>,
    /// Arguments that did not parse; the others are still checked, so every mistake is
    /// reported at once.
    pub(crate) parse_errors: Errors,
    given: usize,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut errors = Errors::default();
        while !input.is_empty() {
            if let Err(error) = args.parse_one(input, &mut errors) {
                // Report it and carry on with the next argument, so one typo does not
                // hide the other mistakes.
                errors.push(error);
                skip_past_comma(input);
                continue;
            }
            if input.is_empty() {
                break;
            }
            if let Err(error) = input.parse::<Token![,]>() {
                errors.push(error);
                skip_past_comma(input);
            }
        }
        args.parse_errors = errors;
        Ok(args)
    }
}

impl Args {
    /// Parses `NAME =`.
    fn name_eq<K: Parse + Spanned>(&mut self, input: ParseStream<'_>) -> syn::Result<At> {
        let span = input.parse::<K>()?.span();
        input.parse::<Token![=]>()?;
        self.given += 1;
        Ok(At {
            span,
            index: self.given,
        })
    }

    fn parse_one(&mut self, input: ParseStream<'_>, errors: &mut Errors) -> syn::Result<()> {
        let lookahead = input.lookahead1();
        if lookahead.peek(kw::key) {
            let at = self.name_eq::<kw::key>(input)?;
            set(errors, &mut self.key, "key", at.with(input.parse()?));
        } else if lookahead.peek(kw::scope) {
            let at = self.name_eq::<kw::scope>(input)?;
            set(errors, &mut self.scope, "scope", at.with(input.parse()?));
        } else if lookahead.peek(kw::retain) {
            let at = self.name_eq::<kw::retain>(input)?;
            set(
                errors,
                &mut self.retain,
                "retain",
                at.with(duration(input, "retain")?),
            );
        } else if lookahead.peek(kw::store) {
            let at = self.name_eq::<kw::store>(input)?;
            set(errors, &mut self.store, "store", at.with(input.parse()?));
        } else if lookahead.peek(kw::name) {
            let at = self.name_eq::<kw::name>(input)?;
            let value = if input.peek(LitStr) {
                input.parse()?
            } else {
                return Err(input.error(
                    "`name` expects a string literal, the operation's name: `name = \"charge\"`",
                ));
            };
            set(errors, &mut self.name, "name", at.with(value));
        } else if lookahead.peek(kw::lease) {
            let at = self.name_eq::<kw::lease>(input)?;
            set(
                errors,
                &mut self.lease,
                "lease",
                at.with(duration(input, "lease")?),
            );
        } else if lookahead.peek(kw::in_flight) {
            let at = self.name_eq::<kw::in_flight>(input)?;
            let lookahead = input.lookahead1();
            let value = if lookahead.peek(kw::wait) {
                input.parse::<kw::wait>()?;
                let content;
                syn::parenthesized!(content in input);
                let lit = duration(&content, "wait")?;
                if !content.is_empty() {
                    return Err(content.error("`wait` takes one duration: `wait(\"5s\")`"));
                }
                InFlightArg::Wait(lit)
            } else if lookahead.peek(kw::reject) {
                input.parse::<kw::reject>()?;
                InFlightArg::Reject
            } else {
                return Err(lookahead.error());
            };
            set(errors, &mut self.in_flight, "in_flight", at.with(value));
        } else if lookahead.peek(kw::errors) {
            let at = self.name_eq::<kw::errors>(input)?;
            let lookahead = input.lookahead1();
            let value = if lookahead.peek(kw::release) {
                input.parse::<kw::release>()?;
                ErrorsArg::Release
            } else if lookahead.peek(kw::record) {
                input.parse::<kw::record>()?;
                ErrorsArg::Record
            } else {
                return Err(lookahead.error());
            };
            set(errors, &mut self.errors, "errors", at.with(value));
        } else if lookahead.peek(kw::classify) {
            let at = self.name_eq::<kw::classify>(input)?;
            set(
                errors,
                &mut self.classify,
                "classify",
                at.with(fn_path(input, "classify")?),
            );
        } else if lookahead.peek(kw::on_takeover) {
            let at = self.name_eq::<kw::on_takeover>(input)?;
            let lookahead = input.lookahead1();
            let value = if lookahead.peek(kw::rerun) {
                input.parse::<kw::rerun>()?;
                TakeoverArg::Rerun
            } else if lookahead.peek(kw::unknown) {
                input.parse::<kw::unknown>()?;
                TakeoverArg::Unknown
            } else {
                return Err(lookahead.error());
            };
            set(errors, &mut self.on_takeover, "on_takeover", at.with(value));
        } else if lookahead.peek(kw::fingerprint) {
            let at = self.name_eq::<kw::fingerprint>(input)?;
            // `none` alone is the keyword; anything longer (`none_of(x)`) is an expression.
            let value = if input.peek(kw::none) && (input.peek2(Token![,]) || ends_after_one(input))
            {
                input.parse::<kw::none>()?;
                FingerprintArg::None
            } else {
                FingerprintArg::Expr(input.parse()?)
            };
            set(errors, &mut self.fingerprint, "fingerprint", at.with(value));
        } else if lookahead.peek(kw::tx) {
            let at = self.name_eq::<kw::tx>(input)?;
            let value = if input.peek(Ident) {
                input.parse()?
            } else {
                return Err(
                    input.error("`tx` expects the name of the transaction parameter: `tx = tx`")
                );
            };
            set(errors, &mut self.tx, "tx", at.with(value));
        } else if lookahead.peek(kw::on_store_error) {
            let at = self.name_eq::<kw::on_store_error>(input)?;
            let lookahead = input.lookahead1();
            let value = if lookahead.peek(kw::fail_closed) {
                input.parse::<kw::fail_closed>()?;
                StoreErrorArg::FailClosed
            } else if lookahead.peek(kw::fail_open) {
                StoreErrorArg::FailOpen(input.parse::<kw::fail_open>()?.span)
            } else {
                return Err(lookahead.error());
            };
            set(
                errors,
                &mut self.on_store_error,
                "on_store_error",
                at.with(value),
            );
        } else if lookahead.peek(kw::version) {
            let at = self.name_eq::<kw::version>(input)?;
            let value = if input.peek(LitInt) {
                input.parse()?
            } else {
                return Err(input.error(
                    "`version` expects an integer literal, the outcome's schema version: `version = 2`",
                ));
            };
            set(errors, &mut self.version, "version", at.with(value));
        } else if lookahead.peek(kw::upgrade) {
            let at = self.name_eq::<kw::upgrade>(input)?;
            set(
                errors,
                &mut self.upgrade,
                "upgrade",
                at.with(fn_path(input, "upgrade")?),
            );
        } else if lookahead.peek(Token![crate]) {
            let at = self.name_eq::<Token![crate]>(input)?;
            let value = if input.peek(LitStr) {
                input.parse::<LitStr>()?.parse_with(Path::parse_mod_style)?
            } else {
                input.call(Path::parse_mod_style)?
            };
            set(errors, &mut self.krate, "crate", at.with(value));
        } else if input.peek(Ident::peek_any) {
            let ident = input.call(Ident::parse_any)?;
            return Err(unknown_argument(&ident));
        } else {
            return Err(lookahead.error());
        }
        Ok(())
    }
}

/// Where an argument's name was read: its span and position.
struct At {
    span: Span,
    index: usize,
}

impl At {
    fn with<T>(self, value: T) -> Arg<T> {
        Arg {
            span: self.span,
            index: self.index,
            value,
        }
    }
}

/// Stores a value, or reports a duplicate at its second occurrence.
fn set<T>(errors: &mut Errors, slot: &mut Option<Arg<T>>, name: &str, arg: Arg<T>) {
    if slot.is_some() {
        errors.push(Error::new(
            arg.span,
            format!("duplicate argument `{name}`; each argument may be given once"),
        ));
    } else {
        *slot = Some(arg);
    }
}

fn duration(input: ParseStream<'_>, name: &str) -> syn::Result<LitStr> {
    if input.peek(LitStr) {
        input.parse()
    } else {
        Err(input.error(format!(
            "`{name}` expects a duration string such as `\"90s\"`, `\"24h\"`, `\"7d\"` or `\"1h 30m\"`"
        )))
    }
}

fn fn_path(input: ParseStream<'_>, name: &str) -> syn::Result<ExprPath> {
    input.parse().map_err(|error| {
        Error::new(
            error.span(),
            format!("`{name}` expects the path of a function, such as `{name} = my_{name}`"),
        )
    })
}

fn ends_after_one(input: ParseStream<'_>) -> bool {
    let fork = input.fork();
    fork.parse::<TokenTree>().is_ok() && fork.is_empty()
}

fn skip_past_comma(input: ParseStream<'_>) {
    let _ = input.step(|cursor| {
        let mut rest = *cursor;
        while let Some((tt, next)) = rest.token_tree() {
            rest = next;
            if let TokenTree::Punct(punct) = &tt
                && punct.as_char() == ','
            {
                break;
            }
        }
        Ok(((), rest))
    });
}

fn unknown_argument(ident: &Ident) -> Error {
    let name = ident.unraw().to_string();
    let expected = ARGUMENTS
        .iter()
        .map(|a| format!("`{a}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let hint = match name.as_str() {
        "ttl" | "expire" | "expires" | "expiry" | "retention" | "keep" => {
            "; how long an outcome is replayed is `retain`"
        }
        "timeout" => "; how long a running claim is owned is `lease`",
        "namespace" | "tenant" => "; the namespace of the key is `scope`",
        "id" | "idempotency_key" => "; the operation's identity is `key`",
        "on_error" => "; what an `Err` does is `errors = release | record` or `classify = PATH`",
        _ => "",
    };
    Error::new(
        ident.span(),
        format!("unknown argument `{name}`; expected one of {expected}{hint}"),
    )
}

/// Reads the `#[idem(...)]` attributes of one parameter: `true` if it is `#[idem(skip)]`.
pub(crate) fn param_skip(attrs: &[Attribute], errors: &mut Errors) -> bool {
    let mut skip = false;
    for attr in attrs.iter().filter(|a| a.path().is_ident("idem")) {
        let parsed = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                if skip {
                    return Err(meta.error("duplicate `skip`; give it once"));
                }
                skip = true;
                Ok(())
            } else {
                Err(meta.error(
                    "unknown `idem` option; expected `skip`, which leaves this parameter out of the fingerprint",
                ))
            }
        });
        if let Err(error) = parsed {
            errors.push(error);
        }
    }
    skip
}

/// Removes `#[idem(...)]` from every parameter: it is ours, rustc does not know it.
pub(crate) fn strip_param_attrs(sig: &mut syn::Signature) {
    for input in &mut sig.inputs {
        let attrs = match input {
            syn::FnArg::Receiver(receiver) => &mut receiver.attrs,
            syn::FnArg::Typed(typed) => &mut typed.attrs,
        };
        attrs.retain(|a| !a.path().is_ident("idem"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &str) -> (Args, Vec<String>) {
        let mut args: Args = syn::parse_str(args).expect("recovers from every argument error");
        let errors = std::mem::take(&mut args.parse_errors)
            .finish()
            .err()
            .map(|e| e.into_iter().map(|e| e.to_string()).collect())
            .unwrap_or_default();
        (args, errors)
    }

    #[test]
    fn every_mistake_is_collected_and_the_rest_still_parses() {
        let (args, errors) =
            parse(r#"key = order.id, ttl = "7d", retain = 7, lease = "1s", retain = "1d""#);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].starts_with("unknown argument `ttl`; expected one of `key`, `scope`"));
        assert!(errors[0].ends_with("how long an outcome is replayed is `retain`"));
        assert!(errors[1].starts_with("`retain` expects a duration string"));
        assert!(args.key.is_some() && args.lease.is_some());
        assert_eq!(args.retain.unwrap().value.value(), "1d");
    }

    #[test]
    fn a_duplicate_is_reported_once_and_the_first_value_kept() {
        let (args, errors) = parse(r#"retain = "1d", key = a, retain = "2d""#);
        assert_eq!(
            errors,
            ["duplicate argument `retain`; each argument may be given once"]
        );
        let retain = args.retain.unwrap();
        assert_eq!((retain.value.value().as_str(), retain.index), ("1d", 1));
    }

    #[test]
    fn fingerprint_none_is_the_keyword_only_on_its_own() {
        for (given, is_none) in [
            ("fingerprint = none", true),
            ("fingerprint = none, key = a", true),
            ("fingerprint = none_of(a)", false),
            ("fingerprint = none.a", false),
        ] {
            let (args, errors) = parse(given);
            assert!(errors.is_empty(), "{given}: {errors:?}");
            let none = matches!(args.fingerprint.unwrap().value, FingerprintArg::None);
            assert_eq!(none, is_none, "{given}");
        }
    }

    #[test]
    fn modes_and_paths_parse() {
        let (args, errors) = parse(
            r#"in_flight = wait("2s"), errors = record, on_takeover = unknown, tx = tx,
               on_store_error = fail_open, version = 2, upgrade = Self::up, crate = "a::b""#,
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert!(matches!(args.in_flight.unwrap().value, InFlightArg::Wait(w) if w.value() == "2s"));
        assert!(matches!(args.errors.unwrap().value, ErrorsArg::Record));
        assert!(matches!(
            args.on_takeover.unwrap().value,
            TakeoverArg::Unknown
        ));
        assert!(matches!(
            args.on_store_error.unwrap().value,
            StoreErrorArg::FailOpen(_)
        ));
        assert_eq!(args.krate.unwrap().value.segments.len(), 2);
        let (_, errors) = parse("in_flight = queue");
        assert_eq!(errors, ["expected `wait` or `reject`"]);
    }
}
