# Starts each service the tests and benches use that is down (sourced by .ci/run and
# benches/run.sh). Only 127.0.0.1.
export IDEM_POSTGRES_URL="${IDEM_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"
export IDEM_MYSQL_URL="${IDEM_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
export IDEM_REDIS_URL="${IDEM_REDIS_URL:-redis://127.0.0.1:6379}"
export IDEM_NATS_URL="${IDEM_NATS_URL:-nats://127.0.0.1:4222}"

wait_port() { # host port: wait up to 30 s for a listener
    for _ in $(seq 1 30); do
        (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && return 0
        sleep 1
    done
    echo "nothing listens on $1:$2" >&2
    return 1
}

# Each service, started if it is down.
if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
    for _ in $(seq 1 30); do
        pg_isready -h 127.0.0.1 -p 5432 -q && break
        sleep 1
    done
fi
psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -d postgres -c "CREATE DATABASE test"

if ! (exec 3<>/dev/tcp/127.0.0.1/3306) 2>/dev/null; then
    echo "starting MariaDB"
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    wait_port 127.0.0.1 3306
fi
if command -v mariadb >/dev/null; then
    for _ in $(seq 1 30); do mariadb -uroot -h127.0.0.1 -e "CREATE DATABASE IF NOT EXISTS test" && break; sleep 1; done
fi

if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    echo "starting Redis"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
    wait_port 127.0.0.1 6379
fi

if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
    echo "starting NATS"
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
        -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server
    wait_port 127.0.0.1 4222
fi

# A local DynamoDB-compatible server: moto's, from PyPI, on port 8000, serving one
# request at a time (.ci/moto_server.py says why); its state is in memory, gone when it
# stops.
export IDEM_DYNAMODB_URL="${IDEM_DYNAMODB_URL:-http://127.0.0.1:8000}"
if ! (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null; then
    if ! python3 -c 'import moto.moto_server.werkzeug_app' 2>/dev/null; then
        echo "installing moto's server"
        pip3 install --quiet 'moto[server]'
    fi
    echo "starting moto's DynamoDB"
    nohup python3 "$(dirname "${BASH_SOURCE[0]}")/moto_server.py" 8000 >/tmp/idem-moto.log 2>&1 &
    wait_port 127.0.0.1 8000
fi
