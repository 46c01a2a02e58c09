//! Transactional mode on PostgreSQL: placing an order and decrementing stock commit in
//! one transaction with idem's claim and record. Run twice with the same key, stock
//! drops once.
//!
//! Run it with `cargo run -p idem-tests --example orders_tx` (PostgreSQL at
//! `IDEM_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`).

use idem_runtime::{Idem, IdemError, idempotent};
use sqlx::{PgPool, Postgres, Transaction};

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("out of stock")]
    OutOfStock,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Idem(#[from] IdemError),
}

/// Places order `order_id` for `qty` of `sku`: one order row and one stock decrement,
/// at most once per order id, all in the caller's transaction.
#[idempotent(store = idem, tx = tx, key = order_id, retain = "30d")]
async fn place_order(
    idem: &Idem,
    tx: &mut Transaction<'_, Postgres>,
    order_id: &str,
    sku: &str,
    qty: i32,
) -> Result<i64, OrderError> {
    let left: Option<i32> = sqlx::query_scalar(
        "UPDATE example_stock SET units = units - $2 WHERE sku = $1 AND units >= $2 RETURNING units",
    )
    .bind(sku)
    .bind(qty)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(_) = left else {
        // A released error: the savepoint rolls back, so no claim is left behind.
        return Err(OrderError::OutOfStock);
    };
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO example_orders (order_ref, sku, qty) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(order_id)
    .bind(sku)
    .bind(qty)
    .fetch_one(&mut **tx)
    .await?;
    Ok(id)
}

async fn stock(pool: &PgPool) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT units FROM example_stock WHERE sku = 'widget'")
        .fetch_one(pool)
        .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = PgPool::connect(&url).await?;
    for ddl in [
        "DROP TABLE IF EXISTS example_orders, example_stock",
        "CREATE TABLE example_stock (sku TEXT PRIMARY KEY, units INT NOT NULL)",
        "CREATE TABLE example_orders (id BIGSERIAL PRIMARY KEY, order_ref TEXT NOT NULL, sku TEXT NOT NULL, qty INT NOT NULL)",
        "INSERT INTO example_stock VALUES ('widget', 10)",
    ] {
        sqlx::query(ddl).execute(&pool).await?;
    }
    let idem = Idem::builder()
        .table("example_idem")
        .pool(pool.clone())
        .await?;
    sqlx::query("DELETE FROM example_idem")
        .execute(&pool)
        .await?;
    println!("stock before: {}", stock(&pool).await?);

    for attempt in 1..=2 {
        let mut tx = pool.begin().await?;
        let order = place_order(&idem, &mut tx, "order-77", "widget", 3).await?;
        tx.commit().await?;
        println!(
            "attempt {attempt}: order row #{order}, stock now {}",
            stock(&pool).await?
        );
    }
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM example_orders")
        .fetch_one(&pool)
        .await?;
    println!("orders placed: {orders}; stock dropped once, by 3");

    let mut tx = pool.begin().await?;
    match place_order(&idem, &mut tx, "order-78", "widget", 100).await {
        Err(e) => println!("order-78 for 100 widgets: {e}; nothing kept"),
        Ok(_) => println!("order-78 unexpectedly placed"),
    }
    tx.commit().await?;
    for ddl in ["DROP TABLE example_orders, example_stock, example_idem"] {
        sqlx::query(ddl).execute(&pool).await?;
    }
    Ok(())
}
