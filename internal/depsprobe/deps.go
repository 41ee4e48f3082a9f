package deps
import (
 _ "connectrpc.com/connect"
 _ "google.golang.org/protobuf/proto"
 _ "aidanwoods.dev/go-paseto"
 _ "go.etcd.io/etcd/server/v3/embed"
 _ "go.etcd.io/etcd/client/v3"
 _ "go.etcd.io/bbolt"
 _ "github.com/prometheus/client_golang/prometheus"
 _ "github.com/creack/pty"
 _ "github.com/fsnotify/fsnotify"
 _ "golang.org/x/sys/unix"
 _ "go.uber.org/goleak"
 _ "golang.org/x/net/http2"
)
