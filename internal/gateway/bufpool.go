package gateway

import "sync"

// proxyBufSize is the copy buffer of one proxied body (what
// httputil.ReverseProxy allocates per request without a pool).
const proxyBufSize = 32 << 10

// BufferPool is an httputil.BufferPool of proxyBufSize buffers: a proxy
// hop otherwise allocates (and zeroes) 32 KiB per request, garbage that
// makes a gateway with a small heap collect every few dozen requests.
type BufferPool struct{ p sync.Pool }

// NewBufferPool returns an empty pool.
func NewBufferPool() *BufferPool {
	return &BufferPool{p: sync.Pool{New: func() any { b := make([]byte, proxyBufSize); return &b }}}
}

// Get returns a buffer of proxyBufSize bytes.
func (bp *BufferPool) Get() []byte { return *(bp.p.Get().(*[]byte)) }

// Put returns b to the pool; buffers of another size are dropped.
func (bp *BufferPool) Put(b []byte) {
	if cap(b) != proxyBufSize {
		return
	}
	b = b[:proxyBufSize]
	bp.p.Put(&b)
}
