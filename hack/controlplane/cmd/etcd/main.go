// Command etcd is the etcd server, built from the same go.etcd.io/etcd/server/v3
// version that the pinned k8s.io/kubernetes requires, so the API server and its
// storage always come from one consistent dependency graph.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
