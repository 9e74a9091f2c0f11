// A js-libp2p peer reads a meshtrain peer record: kad GET_VALUE through the node at BOOTSTRAP,
// then opens and verifies it with the rule of docs/interop.md (meshtrain/dht/interop.py is the
// same rule in Python). Prints one JSON line: {"verified": true, "record": {...}, "latency_ms": n}
// or {"verified": false, "error": "..."}; exits 0 either way (the caller asserts).
//
//     node kad_get_record.mjs BOOTSTRAP_MULTIADDR KEY [TIMEOUT_MS]
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { kadDHT, passthroughMapper } from '@libp2p/kad-dht'
import { RecordEnvelope } from '@libp2p/peer-record'
import { peerIdFromPublicKey } from '@libp2p/peer-id'
import { multiaddr } from '@multiformats/multiaddr'

// js-libp2p 3 wants Node >= 22 for Promise.withResolvers; Debian's Node 20 lacks it (the only
// gap met here): the standard polyfill.
Promise.withResolvers ??= function () {
  let resolve, reject
  const promise = new Promise((res, rej) => { resolve = res; reject = rej })
  return { promise, resolve, reject }
}

const DOMAIN = 'meshtrain-record'
const PAYLOAD_TYPE = '/meshtrain/peer/1'
const MAX_VALUE_BYTES = 2048
const MAX_ADDRS = 4
const MAX_TTL_S = 3600
const CLOCK_SKEW_S = 300
const FIELDS = ['addrs', 'expiry', 'key', 'role', 'seq', 'version']

const text = (bytes) => new TextDecoder().decode(bytes)

// The validation rule (docs/interop.md): throws saying why a value is not a valid record for key.
async function openRecord (key, value) {
  if (value.length > MAX_VALUE_BYTES) throw new Error('oversized')
  const keyStr = text(key)
  const parts = keyStr.split('/')
  if (parts.length !== 5 || parts[0] !== '' || parts[1] !== 'meshtrain' || parts[3] !== 'peer' || parts[2] === '') {
    throw new Error(`not a meshtrain peer key: ${keyStr}`)
  }
  const envelope = await RecordEnvelope.openAndCertify(value, DOMAIN) // throws unless the signature verifies
  if (text(envelope.payloadType) !== PAYLOAD_TYPE) throw new Error('not a meshtrain peer record')
  const signer = peerIdFromPublicKey(envelope.publicKey).toString()
  if (signer !== parts[4]) throw new Error('signed by another peer than the key names')
  const body = JSON.parse(text(envelope.payload))
  if (typeof body !== 'object' || body === null || Object.keys(body).sort().join() !== FIELDS.join()) {
    throw new Error('the payload has exactly ' + FIELDS.join(', '))
  }
  if (body.key !== keyStr) throw new Error('signed for another key')
  if (!Number.isSafeInteger(body.seq) || body.seq < 0) throw new Error('seq is a non-negative integer')
  const now = Date.now() / 1000
  if (typeof body.expiry !== 'number' || body.expiry <= now) throw new Error('expired')
  if (body.expiry > now + MAX_TTL_S + CLOCK_SKEW_S) throw new Error('expires too far ahead')
  if (!Array.isArray(body.addrs) || body.addrs.length > MAX_ADDRS) throw new Error('too many addresses')
  for (const a of body.addrs) {
    if (multiaddr(a).getComponents().filter(c => c.name === 'p2p').pop()?.value !== signer) {
      throw new Error('an address that does not name the signer')
    }
  }
  return { ...body, peer: signer }
}

async function seqOf (key, value) {
  try { return (await openRecord(key, value)).seq } catch { return -1 }
}

const [bootstrap, key, timeoutArg] = process.argv.slice(2)
const timeoutMs = Number(timeoutArg ?? 20000)
const node = await createLibp2p({
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: {
    identify: identify(),
    ping: ping(), // kad-dht needs it
    dht: kadDHT({
      protocol: '/ipfs/kad/1.0.0',
      clientMode: true,
      peerInfoMapper: passthroughMapper, // loopback addresses are what a test has
      validators: { meshtrain: async (k, v) => { await openRecord(k, v) } },
      selectors: {
        meshtrain: async (k, values) => {
          const seqs = await Promise.all(values.map(v => seqOf(k, v)))
          return seqs.indexOf(Math.max(...seqs))
        }
      }
    })
  }
})
const out = { verified: false }
try {
  await node.dial(multiaddr(bootstrap), { signal: AbortSignal.timeout(timeoutMs) })
  const keyBytes = new TextEncoder().encode(key)
  const started = performance.now()
  const deadline = Date.now() + timeoutMs
  let value
  while (value === undefined && Date.now() < deadline) {
    try {
      for await (const event of node.services.dht.get(keyBytes, { signal: AbortSignal.timeout(deadline - Date.now()) })) {
        if (event.name === 'VALUE') { value = event.value; break }
      }
    } catch (e) {
      out.last_error = String(e)
    }
    if (value === undefined) await new Promise(resolve => setTimeout(resolve, 250))
  }
  out.latency_ms = Math.round(performance.now() - started)
  if (value === undefined) throw new Error(`no value for ${key} within ${timeoutMs} ms`)
  out.record = await openRecord(keyBytes, value)
  out.verified = true
} catch (e) {
  out.error = String(e)
} finally {
  await node.stop()
}
console.log(JSON.stringify(out))
