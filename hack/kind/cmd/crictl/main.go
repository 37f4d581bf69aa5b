// Command crictl is a small stand-in for cri-tools' crictl (whose module the Go proxy does not
// serve) covering what kind and a person debugging a node use: `crictl images` and
// `crictl inspecti IMAGE` (JSON with status.id and status.repoTags, as crictl prints it).
// It talks to the CRI endpoint of /etc/crictl.yaml (default unix:///run/containerd/containerd.sock).
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	criclient "k8s.io/cri-client/pkg"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"go.opentelemetry.io/otel/trace/noop"
)

func endpoint() string {
	if e := os.Getenv("CONTAINER_RUNTIME_ENDPOINT"); e != "" {
		return e
	}
	if b, err := os.ReadFile("/etc/crictl.yaml"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "runtime-endpoint" {
				return strings.TrimSpace(v)
			}
		}
	}
	return "unix:///run/containerd/containerd.sock"
}

func die(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "crictl: "+format+"\n", a...)
	os.Exit(1)
}

func main() {
	args := []string{}
	for _, a := range os.Args[1:] {
		if !strings.HasPrefix(a, "-") {
			args = append(args, a)
		}
	}
	if len(args) == 0 {
		die("usage: crictl images | crictl inspecti IMAGE")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	svc, err := criclient.NewRemoteImageService(ctx, endpoint(), 10*time.Second, noop.NewTracerProvider(), false)
	if err != nil {
		die("connect: %v", err)
	}
	switch args[0] {
	case "images", "img":
		imgs, err := svc.ListImages(ctx, &runtimeapi.ImageFilter{})
		if err != nil {
			die("list images: %v", err)
		}
		fmt.Printf("%-70s %-20s %s\n", "IMAGE", "IMAGE ID", "SIZE")
		for _, im := range imgs {
			id := strings.TrimPrefix(im.Id, "sha256:")
			if len(id) > 13 {
				id = id[:13]
			}
			tags := im.RepoTags
			if len(tags) == 0 {
				tags = []string{"<none>"}
			}
			for _, t := range tags {
				fmt.Printf("%-70s %-20s %d\n", t, id, im.GetSize())
			}
		}
	case "inspecti":
		if len(args) < 2 {
			die("inspecti needs an image")
		}
		resp, err := svc.ImageStatus(ctx, &runtimeapi.ImageSpec{Image: args[1]}, false)
		if err != nil {
			die("image status: %v", err)
		}
		if resp.Image == nil {
			die("no such image %q present", args[1])
		}
		out, _ := json.MarshalIndent(map[string]any{"status": resp.Image}, "", "  ")
		fmt.Println(string(out))
	default:
		die("unsupported command %q (this stand-in knows images and inspecti)", args[0])
	}
}
