//! Emission: the function with its body handed to the runtime's builder.

use std::time::Duration;

use proc_macro2::{Literal, Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Attribute, Error, Expr, LitStr, Signature, Type, Visibility};

use crate::attr::{self, Args, StoreErrorArg, TakeoverArg};
use crate::check::{self, Fingerprint, InFlight, OnErr, Plan};

/// The annotated function with its body kept as tokens: a syntax error inside the body
/// is rustc's to report, where it is, once (tokio-macros does the same).
pub(crate) struct ItemFn {
    attrs: Vec<Attribute>,
    vis: Visibility,
    pub(crate) sig: Signature,
    block: proc_macro2::Group,
}

impl Parse for ItemFn {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis = input.parse()?;
        let sig = input.parse()?;
        let block: proc_macro2::Group = input.parse()?;
        if block.delimiter() != proc_macro2::Delimiter::Brace || !input.is_empty() {
            return Err(input.error("expected the function's body"));
        }
        Ok(ItemFn {
            attrs,
            vis,
            sig,
            block,
        })
    }
}

impl ToTokens for ItemFn {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        for attr in &self.attrs {
            attr.to_tokens(tokens);
        }
        self.vis.to_tokens(tokens);
        self.sig.to_tokens(tokens);
        self.block.to_tokens(tokens);
    }
}

/// The whole attribute: parse, check, emit; on error, the errors beside the original
/// function (without its `#[idem]` attributes), so the caller sees one error, not a cascade.
pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(_) => {
            let error = Error::new(
                Span::call_site(),
                "`#[idempotent]` applies to an `async fn` with a body (a free function or a \
                 method in an `impl` block)",
            );
            return with_error(error, item);
        }
    };
    let plan = syn::parse::Parser::parse2(<Args as syn::parse::Parse>::parse, args)
        .and_then(|args| check::validate(args, &func.sig, &func.attrs));
    attr::strip_param_attrs(&mut func.sig);
    match plan {
        Ok(plan) => emit(plan, func),
        Err(error) => with_error(error, func.into_token_stream()),
    }
}

fn with_error(error: Error, item: TokenStream) -> TokenStream {
    let error = error.to_compile_error();
    quote!(#error #item)
}

fn emit(plan: Plan, func: ItemFn) -> TokenStream {
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = func;
    let krate = &plan.krate;
    let private = quote!(#krate::__private);
    let lit = LitStr::new(&plan.name, sig.ident.span());
    let key = by_ref(&plan.key);

    // A defaulted name is registered with the function's site, so the runtime can refuse
    // it when another function defaults to it too (two `refund`s in two modules).
    let (site, name) = if plan.name_is_default {
        // Spanned on the function's name, so `file!` and `line!` give its place.
        let at = sig.ident.span();
        let file = quote_spanned!(at=> ::core::file!());
        let line = quote_spanned!(at=> ::core::line!());
        let site = quote! {
            static __IDEM_NAME: #private::DefaultedName = #private::DefaultedName::new(
                #lit,
                ::core::module_path!(),
                #file,
                #line,
            );
            #private::inventory::submit! { #private::Registered(&__IDEM_NAME) }
        };
        (site, quote!(&__IDEM_NAME))
    } else {
        (TokenStream::new(), lit.into_token_stream())
    };

    // A key the client chose (an `IdempotencyKey`) needs the principal in `scope`: the
    // check is a closure that is type-checked and never called, so the key is not
    // evaluated twice.
    let site = match &plan.scope {
        Some(_) => site,
        None => {
            let check = quote_spanned! {plan.key.span()=>
                #[allow(unused_imports)]
                use #private::{AnyKeyCheck as _, ClientChosenCheck as _};
                let _ = || (&#private::KeyCheck(#key)).check_unscoped_key();
            };
            quote!(#site #check)
        }
    };

    let mut op = match &plan.store {
        Some(store) => {
            let store = by_ref(store);
            quote!(#private::operation(#store, #name, #key))
        }
        None => quote!(#private::global_operation(#name, #key)),
    };
    if let Some(scope) = &plan.scope {
        let scope = by_ref(scope);
        op.extend(quote!(.scope(#scope)));
    }
    let retain = duration(&private, plan.retain);
    op.extend(quote!(.retain(#retain)));
    if let Some(lease) = plan.lease {
        let lease = duration(&private, lease);
        op.extend(quote!(.lease(#lease)));
    }
    match plan.in_flight {
        Some(InFlight::Wait(wait)) => {
            let wait = duration(&private, wait);
            op.extend(quote!(.in_flight(#private::InFlight::Wait(#wait))));
        }
        Some(InFlight::Reject) => op.extend(quote!(.in_flight(#private::InFlight::Reject))),
        None => {}
    }
    match plan.on_takeover {
        Some(TakeoverArg::Rerun) => op.extend(quote!(.on_takeover(#private::Takeover::Rerun))),
        Some(TakeoverArg::Unknown) => {
            op.extend(quote!(.on_takeover(#private::Takeover::Unknown)));
        }
        None => {}
    }
    match plan.on_store_error {
        Some(StoreErrorArg::FailClosed) => {
            op.extend(quote!(.on_store_error(#private::OnStoreError::FailClosed)));
        }
        Some(StoreErrorArg::FailOpen(_)) => {
            op.extend(quote!(.on_store_error(#private::OnStoreError::FailOpen)));
        }
        None => {}
    }
    match &plan.fingerprint {
        Fingerprint::Params(params) if params.is_empty() => {
            op.extend(quote!(.fingerprint_none()));
        }
        Fingerprint::Params(params) => {
            for param in params {
                let label = LitStr::new(&param.to_string(), param.span());
                // Spanned on the parameter: a type that is not `Serialize` is reported
                // there, with the runtime's message on `#[idem(skip)]`.
                op = quote_spanned! {param.span()=>
                    #private::fingerprint_param(#op, #label, &#param)
                };
            }
        }
        Fingerprint::Expr(expr) => {
            let expr = by_ref(expr);
            op.extend(quote!(.fingerprint(#expr)));
        }
        Fingerprint::None => op.extend(quote!(.fingerprint_none())),
    }
    if let Some(version) = plan.version {
        let version = Literal::u32_unsuffixed(version);
        op.extend(quote!(.version(#version)));
    }
    if let Some(upgrade) = &plan.upgrade {
        op.extend(quote_spanned!(upgrade.span()=> .upgrade(#upgrade)));
    }
    match &plan.on_err {
        OnErr::Release => {}
        OnErr::Record => op.extend(quote!(.record_errors())),
        OnErr::Classify(classify) => {
            op.extend(quote_spanned!(classify.span()=> .classify(#classify)));
        }
    }

    let ret = &plan.ret;
    let fake_return = fake_return(ret);
    let block = body_block(block);
    // The calls whose bounds are about the return type (`T: Serialize`,
    // `E: From<IdemError>`, a recordable `E`) are spanned on it, each with its `.await`.
    let ret_at = ret.span();
    let body = match &plan.tx {
        None => {
            let run = awaited_call(
                ret_at,
                quote!(__idem_op.run),
                quote!(move || async move { #fake_return #block }),
            );
            quote! {
                let __idem_op = #op;
                #run
            }
        }
        Some(tx) => {
            // Spanned on the parameter's type, where a wrong transaction type is fixed.
            let tx_ty = sig.inputs.iter().find_map(|arg| match arg {
                syn::FnArg::Typed(pt) => match &*pt.pat {
                    syn::Pat::Ident(pi) if pi.ident == *tx => Some(pt.ty.span()),
                    _ => None,
                },
                syn::FnArg::Receiver(_) => None,
            });
            let tx_at = tx_ty.unwrap_or_else(|| tx.span());
            let begin = awaited_call(
                tx_at,
                quote!(__idem_op.begin_tx),
                respan(quote!(&mut *#tx), tx_at),
            );
            // Both halves on one span, so a bound they share (`C: TxConnection` above
            // all) is reported once.
            let finish = awaited_call(
                tx_at,
                quote!(__idem_guard.finish),
                respan(quote!(&mut *#tx, __idem_out), tx_at),
            );
            quote! {
            let __idem_op = #op;
            let __idem_guard = match #begin {
                ::core::result::Result::Ok(#private::TxStep::Replay(__idem_v)) => return __idem_v,
                ::core::result::Result::Ok(#private::TxStep::Run(__idem_g)) => __idem_g,
                ::core::result::Result::Err(__idem_e) => {
                    return ::core::result::Result::Err(::core::convert::From::from(__idem_e));
                }
            };
            let __idem_out: #ret = {
                // A reborrow, so the body may move `tx` and it is still ours afterwards; a
                // body that never touches `tx` is fine, the claim and record use it.
                #[allow(unused_variables)]
                let #tx = &mut *#tx;
                __idem_guard.body(async move { #fake_return #block }).await
            };
            #finish
            }
        }
    };
    quote! {
        #(#attrs)*
        #vis #sig {
            #site
            #body
        }
    }
}

/// `&(expr)`, spanned on the expression so trait errors (`KeyPart`, `Serialize`,
/// `AsRef<Idem>`) land on the user's tokens. A tuple becomes a tuple of references, so
/// `(order.id, tenant)` borrows its fields instead of moving them out.
fn by_ref(expr: &Expr) -> TokenStream {
    match expr {
        Expr::Tuple(tuple) if !tuple.elems.is_empty() => {
            let elems = tuple.elems.iter().map(by_ref);
            quote_spanned!(expr.span()=> &(#(#elems,)*))
        }
        Expr::Paren(paren) => by_ref(&paren.expr),
        _ => quote_spanned!(expr.span()=> &(#expr)),
    }
}

/// `method(args).await`, the call and its `.await` spanned on `at` (a token of the
/// user's): an unmet bound of the method is then reported once, there, rather than once
/// for the call and again for the `.await` of the future it returns, on the attribute.
fn awaited_call(at: Span, method: TokenStream, args: TokenStream) -> TokenStream {
    let method = respan(method, at);
    let mut args = proc_macro2::Group::new(proc_macro2::Delimiter::Parenthesis, args);
    args.set_span(at);
    quote_spanned!(at=> #method #args .await)
}

/// `tokens` with every top-level token spanned on `at`: generated names and punctuation,
/// and at most the user's `tx` name, which resolves alike on any span of the user's.
fn respan(tokens: TokenStream, at: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            token.set_span(at);
            token
        })
        .collect()
}

/// The body's block with its braces marked as the macro's: they sit in a position
/// (the tail of our async block) where rustc's `unused_braces` would flag a one-line
/// body such as `{ Ok(x) }` and suggest removing braces the user's code needs. The
/// braces keep their place in the source, and the statements inside keep their own
/// spans, so every lint on the user's own code still fires.
fn body_block(block: proc_macro2::Group) -> proc_macro2::Group {
    let mut braces = proc_macro2::Group::new(block.delimiter(), block.stream());
    braces.set_span(block.span().resolved_at(Span::call_site()));
    braces
}

fn duration(private: &TokenStream, d: Duration) -> TokenStream {
    let secs = Literal::u64_unsuffixed(d.as_secs());
    let nanos = Literal::u32_unsuffixed(d.subsec_nanos());
    quote!(#private::Duration::new(#secs, #nanos))
}

/// Pins the async block's output to the declared return type, so `?` and `return` in the
/// body infer as they did in the original function (the trick `tracing-attributes` uses).
fn fake_return(ret: &Type) -> TokenStream {
    quote_spanned! {ret.span()=>
        #[allow(
            unknown_lints,
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::let_with_type_underscore,
            clippy::needless_return,
            clippy::unreachable
        )]
        if false {
            let __idem_ret: #ret = loop {};
            return __idem_ret;
        }
    }
}
