//! `?` and early `return` in the body keep their meaning, with the fn's own error type.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};

#[derive(Debug)]
pub enum AppError {
    Parse(std::num::ParseIntError),
    Empty,
    Idem(IdemError),
}

impl From<IdemError> for AppError {
    fn from(e: IdemError) -> Self {
        AppError::Idem(e)
    }
}

impl From<std::num::ParseIntError> for AppError {
    fn from(e: std::num::ParseIntError) -> Self {
        AppError::Parse(e)
    }
}

#[idempotent(store = idem, key = raw, retain = "1h")]
async fn parse(idem: &Idem, raw: &str) -> Result<u64, AppError> {
    if raw.is_empty() {
        return Err(AppError::Empty);
    }
    let n: u64 = raw.trim().parse()?;
    if n == 0 {
        return Ok(0);
    }
    let doubled = async { Ok::<_, AppError>(n * 2) }.await?;
    Ok(doubled)
}

/// An alias of `Result` is accepted as the return type.
pub type AppResult<T> = Result<T, AppError>;

#[idempotent(store = idem, key = raw, retain = "1h")]
async fn parse_alias(idem: &Idem, raw: String) -> AppResult<u64> {
    let n = raw.parse::<u64>()?;
    Ok(n)
}

fn main() {}
